"""TRL's SFT, DPO and GRPO trainers with kernels-core: same losses and metrics as without it.

TRL patches its own fused LM head onto the ``*ForCausalLM`` after ``Trainer.__init__`` and calls it with
``fused_lm_head=True``: it runs the backbone (``model.base_model``) and scores the labelled positions in tiles,
returning the per-token log-probabilities, entropy and top-1 hits its losses and metrics need. kernels-core's
fused loss returns one scalar, so TRL's head must compute the loss; kernels-core's kernels run in the backbone
under it. Each trainer runs three times from the same seed in float32 on the CPU: plain, with the callback, and
with a model kernelized before the trainer was built; every logged step must agree (1e-4 relative).
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from _trainer_helpers import assert_logs_equal
from _trainer_helpers import word_tokenizer
from _trainer_helpers import words
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


REASON = "needs kernels-core's trl extra (nox -s \"tests(vendor='integrations')\" installs it)"
trl = pytest.importorskip("trl", reason=REASON)
datasets = pytest.importorskip("datasets", reason=REASON)

from kernels_core.integrations.transformers import KernelizeCallback  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 and its tokenizer saved locally: DPO and GRPO load their reference model from its path."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_causal_lm("qwen3").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)


def _common(tmp_path, steps):
    return dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
                learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, use_cpu=True, bf16=False,
                disable_tqdm=True)


def _reward(completions, **kwargs):
    return [len(set(text.split())) / 8.0 for text in completions]


def _run(kind, model_dir, tmp_path, *, how):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if how == "before":
        kernels_core.kernelize(model, plugin_manager=fresh_plugin_manager())
    callbacks = [KernelizeCallback(plugin_manager=fresh_plugin_manager())] if how == "callback" else []
    g = torch.Generator().manual_seed(0)
    tokenizer = word_tokenizer()
    if kind == "sft":
        data = datasets.Dataset.from_list([{"text": words(g, 12)} for _ in range(32)])
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**_common(tmp_path, 6), max_length=16),
                                 train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    elif kind == "dpo":
        data = datasets.Dataset.from_list([{"prompt": words(g, 6), "chosen": words(g, 5), "rejected": words(g, 5)}
                                           for _ in range(32)])
        trainer = trl.DPOTrainer(model=model, args=trl.DPOConfig(**_common(tmp_path, 4), max_length=16),
                                 train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    else:
        data = datasets.Dataset.from_list([{"prompt": words(g, 6)} for _ in range(16)])
        config = trl.GRPOConfig(**_common(tmp_path, 3), num_generations=4, max_completion_length=6, beta=0.1)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    return trainer, model


METRICS = {
    "sft": ("loss", "mean_token_accuracy", "entropy", "grad_norm"),
    "dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "grad_norm"),
    "grpo": ("loss", "reward", "kl", "grad_norm"),
}


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_trainer_matches_plain_and_trl_head_computes_the_loss(kind, model_dir, tmp_path):
    plain, _ = _run(kind, model_dir, tmp_path, how="plain")
    for how in ("callback", "before"):
        trainer, model = _run(kind, model_dir, tmp_path, how=how)
        assert_logs_equal(trainer.state.log_history, plain.state.log_history, METRICS[kind])
        report = kernels_core.get_report(model)
        assert {e.kind for e in report.applied} >= {"rms_norm", "silu_gated_mlp"}, report.summary()
        # TRL's head wraps the *ForCausalLM forward and computes the loss from the backbone's hidden states.
        assert "_fused_forward" == model.forward.__func__.__code__.co_name
        if how == "callback":
            (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, KernelizeCallback)]
            assert callback.loss.startswith("Qwen3ForCausalLM: TRL's fused LM head"), callback.loss
            (entry,) = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
            assert "TRL's fused LM head" in (entry.note or entry.reason)
