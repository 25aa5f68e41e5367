"""``KernelizeCallback`` in transformers' ``Trainer``: same losses, evaluation with logits, report, errors.

Every comparison runs the same Trainer twice from the same seed, without and with the callback, in float32 on
the CPU with the core's portable kernels, and compares the logged loss of every step. The fused loss differs
from eager by summation order only, so the bound (1e-4 relative, ten times tighter than the product target of
1e-3) leaves room for twenty AdamW steps to amplify rounding but not for a wrong normalisation.
"""

from __future__ import annotations

import json
import logging
import types

import kernels_core
import pytest
import torch
from _trainer_helpers import assert_losses_equal
from _trainer_helpers import pad_collate
from _trainer_helpers import step_losses
from _trainer_helpers import token_dataset
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")
from kernels_core.integrations._trainer_callback import REPORT_FILE  # noqa: E402
from kernels_core.integrations.transformers import KernelizeCallback  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    max_steps=20, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0,
                    use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    return TrainingArguments(**settings)


def _train(tmp_path, callback, *, model_type="qwen3", dataset=None, **overrides):
    model = tiny_causal_lm(model_type)
    trainer = Trainer(model=model, args=_args(tmp_path, **overrides), train_dataset=dataset or token_dataset(),
                      data_collator=pad_collate, callbacks=[callback] if callback else [])
    trainer.train()
    return trainer, model


def _forwards(model):
    keys = ("forward", "_old_forward", "_kernels_core_binding", "_kernels_core_report")
    return {name: {k: m.__dict__.get(k) for k in keys} for name, m in model.named_modules()}


def test_losses_and_weights_match_the_plain_trainer(tmp_path, pm, model_type="qwen3"):
    plain, plain_model = _train(tmp_path, None, model_type=model_type)
    callback = KernelizeCallback(plugin_manager=pm)
    fused, model = _train(tmp_path, callback, model_type=model_type)
    assert_losses_equal(step_losses(fused), step_losses(plain), what=model_type)
    report = kernels_core.get_report(model)
    assert report is not None and report.mode == "TRAINING"
    assert {e.kind for e in report.applied} >= {"causal_lm_loss", "rms_norm", "silu_gated_mlp"}
    for (name, a), b in zip(model.named_parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} after 20 steps")
    assert "kernels-core's fused loss any.causal_lm_loss" in callback.loss


@pytest.mark.parametrize("overrides", [
    {"gradient_accumulation_steps": 3, "max_steps": 4},
    {"gradient_accumulation_steps": 2, "average_tokens_across_devices": False, "max_steps": 4},
    {"gradient_checkpointing": True, "max_steps": 4},
], ids=["accumulation", "accumulation-no-token-average", "checkpointing"])
def test_losses_match_with_accumulation_and_checkpointing(tmp_path, pm, overrides):
    # Ragged rows with masked labels: the loss must be normalised by the tokens of the whole accumulated batch
    # (num_items_in_batch), which a per-micro-batch mean would get wrong.
    data = token_dataset(ragged=True)
    plain, _ = _train(tmp_path, None, dataset=data, **overrides)
    fused, model = _train(tmp_path, KernelizeCallback(plugin_manager=pm), dataset=data, **overrides)
    assert kernels_core.get_report(model).applied
    assert_losses_equal(step_losses(fused), step_losses(plain), what=str(overrides))


def test_bf16_mixed_precision_keeps_the_fused_loss(tmp_path, pm):
    # accelerate wraps the model's forward in autocast when bf16=True; kernelizing at the end of Trainer.__init__,
    # before that, puts the fused loss inside the wrapper (after it, the loss kind would have to leave it alone).
    plain, _ = _train(tmp_path, None, bf16=True, max_steps=6)
    fused, model = _train(tmp_path, KernelizeCallback(plugin_manager=pm), bf16=True, max_steps=6)
    assert "_original_forward" in model.__dict__, "accelerate did not wrap the forward for mixed precision"
    loss = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
    assert loss[0].applied, loss
    # bf16 autocast: the fused loss rounds the matmul per chunk like the eager one, in another order.
    assert_losses_equal(step_losses(fused), step_losses(plain), rtol=2e-3, what="bf16 autocast")


def test_callback_added_after_construction_kernelizes_at_train_begin(tmp_path, pm):
    plain, _ = _train(tmp_path, None, max_steps=4)
    model = tiny_causal_lm("qwen3")
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=4), train_dataset=token_dataset(),
                      data_collator=pad_collate)
    trainer.add_callback(KernelizeCallback(plugin_manager=pm))
    assert kernels_core.get_report(model) is None
    trainer.train()
    assert kernels_core.get_report(model).applied
    assert_losses_equal(step_losses(trainer), step_losses(plain), what="added after construction")


def test_torch_compile_uses_the_compile_mode(tmp_path, pm):
    overrides = {"torch_compile": True, "torch_compile_backend": "aot_eager", "max_steps": 4}
    plain, _ = _train(tmp_path, None, **overrides)
    fused, model = _train(tmp_path, KernelizeCallback(plugin_manager=pm), **overrides)
    assert fused.model_wrapped is not model, "the Trainer did not compile the model"
    assert kernels_core.get_report(model).mode == "TRAINING|TORCH_COMPILE"
    assert_losses_equal(step_losses(fused), step_losses(plain), what="torch_compile")


def test_compute_metrics_gets_the_real_logits(tmp_path, pm):
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "kernelized": []}

    def metrics(which):
        def compute(prediction):
            seen[which].append(torch.as_tensor(prediction.predictions))
            return {"mean_logit": float(prediction.predictions.mean())}
        return compute

    results = {}
    for which, callback in (("plain", None), ("kernelized", KernelizeCallback(plugin_manager=pm))):
        model = tiny_causal_lm("qwen3")
        trainer = Trainer(model=model, args=_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=4),
                          train_dataset=token_dataset(), eval_dataset=token_dataset(8, seed=1),
                          data_collator=pad_collate, compute_metrics=metrics(which),
                          callbacks=[callback] if callback else [])
        trainer.train()
        with_metrics = trainer.evaluate()
        trainer.compute_metrics = None  # evaluate() then asks for the loss only
        results[which] = (trainer.state.log_history, with_metrics, trainer.evaluate(),
                          trainer.predict(token_dataset(4)))
    assert len(seen["kernelized"]) == 2, "compute_metrics was not called in and after training"
    for a, b in zip(seen["kernelized"], seen["plain"], strict=True):
        assert a.shape == (8, 12, 101), f"compute_metrics got {tuple(a.shape)}, not [rows, tokens, vocab] logits"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    k_log, k_eval, k_loss_only, k_pred = results["kernelized"]
    p_log, p_eval, p_loss_only, p_pred = results["plain"]
    k_evals = [e["eval_loss"] for e in k_log if "eval_loss" in e]
    assert_losses_equal(k_evals + [k_eval["eval_loss"], k_loss_only["eval_loss"]],
                        [e["eval_loss"] for e in p_log if "eval_loss" in e] + [p_eval["eval_loss"],
                                                                               p_loss_only["eval_loss"]])
    assert k_pred.predictions.shape == (4, 12, 101)
    torch.testing.assert_close(torch.as_tensor(k_pred.predictions), torch.as_tensor(p_pred.predictions),
                               rtol=1e-4, atol=1e-5)


def test_report_file_and_log_line(tmp_path, pm):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers.trainer.kernels_core")
    log.addHandler(handler)
    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        trainer, model = _train(tmp_path, KernelizeCallback(plugin_manager=pm), max_steps=2)
    finally:
        transformers.logging.set_verbosity(previous)
        log.removeHandler(handler)
    summary = kernels_core.get_report(model).summary()
    assert [r.getMessage().split("; loss: ")[0] for r in records] == [summary]
    written = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert written["summary"] == summary and written["mode"] == "TRAINING"
    assert written["loss"].startswith("Qwen3ForCausalLM: kernels-core's fused loss")
    assert {e["kind"] for e in written["entries"]} >= {"causal_lm_loss", "rms_norm"}


def test_kernels_stay_after_training_and_a_second_train_matches(tmp_path, pm):
    data = token_dataset()
    model = tiny_causal_lm("qwen3")
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=3), train_dataset=data, data_collator=pad_collate,
                      callbacks=[KernelizeCallback(plugin_manager=pm)])
    trainer.train()
    first = kernels_core.get_report(model)
    assert first is not None, "the kernels should stay bound after train()"
    trainer.train()  # kernelizes again from scratch: same choices, no double binding
    assert kernels_core.get_report(model).summary() == first.summary()
    kernels_core.unkernelize(model)
    assert all("_kernels_core_binding" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(("options", "error", "names"), [
    ({"mode": "training"}, TypeError, "option 'mode' must be a kernels_core.Mode"),
    ({"mode": Mode.TRAINING | Mode.INFERENCE}, ValueError, "option 'mode'.*mutually exclusive"),
    ({"strict": 1}, TypeError, "option 'strict' must be a bool, got int"),
    ({"config": 3}, TypeError, "option 'config' must be a dict"),
    ({"config": {"kinds": {"rms_norm": {"enabeld": False}}}}, kernels_core.ConfigError, "option 'config'.*enabeld"),
    ({"plugin_manager": "pm"}, TypeError, "option 'plugin_manager'"),
    ({"local_shard_step": "yes"}, TypeError, "option 'local_shard_step' must be a bool or None, got str"),
])
def test_bad_options_raise_naming_the_option(options, error, names):
    with pytest.raises(error, match=names):
        KernelizeCallback(**options)


def test_local_shard_step_required_without_fsdp2_raises_when_training_begins(tmp_path, pm):
    with pytest.raises(KernelizeError, match=r"local_shard_step=True.*AdamW cannot step on local shards: no "
                                             r"parameter is a DTensor"):
        _train(tmp_path, KernelizeCallback(plugin_manager=pm, local_shard_step=True), max_steps=1)


def test_local_shard_step_required_without_an_optimizer_raises(pm):
    callback = KernelizeCallback(plugin_manager=pm, local_shard_step=True)
    with pytest.raises(KernelizeError, match="passed no optimizer"):
        callback._optimizer(None)
    KernelizeCallback(plugin_manager=pm)._optimizer(None)  # automatic: nothing to do, nothing raised


def test_without_fsdp2_the_optimizer_is_left_alone(tmp_path, pm):
    callback = KernelizeCallback(plugin_manager=pm)
    trainer, _ = _train(tmp_path, callback, max_steps=1)
    assert callback.optimizer_step is None
    assert "step" not in vars(trainer.optimizer.optimizer)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        KernelizeCallback(Mode.TRAINING)  # type: ignore[misc]


def _failing_bind(module, match, kernel, forward):
    raise RuntimeError("no launch configuration for this shape")


def test_a_failing_kernelize_names_the_kernel_and_leaves_the_model_alone(tmp_path):
    plugin = types.ModuleType("plugin_broken")
    spec = KernelSpec(id="broken.rms_norm", kind="rms_norm", variants=("standard",), backend="cpu",
                      impl="kernels_core._kinds._reference:rms_norm", priority=90,
                      supports=Supports.BACKWARD | Supports.TORCH_COMPILE)
    plugin.kernels_core_kernels = hookimpl(lambda: [spec])
    plugin.kernels_core_bind_kernel = hookimpl(_failing_bind)
    pm = fresh_plugin_manager((plugin, "broken"))
    model = tiny_causal_lm("qwen3")
    before = _forwards(model)
    with pytest.raises(KernelizeError, match=r"KernelizeCallback: kernelize\(Qwen3ForCausalLM.*unchanged.*"
                                             r"plugin 'broken'.*broken\.rms_norm.*no launch configuration"):
        Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=token_dataset(),
                data_collator=pad_collate, callbacks=[KernelizeCallback(plugin_manager=pm)])
    assert _forwards(model) == before
    # Added after the Trainer was built, the callback kernelizes when training begins: same error, same guarantee.
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=token_dataset(),
                      data_collator=pad_collate)
    trainer.add_callback(KernelizeCallback(plugin_manager=pm))
    with pytest.raises(KernelizeError, match=r"failed when training began.*broken\.rms_norm"):
        trainer.train()
    assert _forwards(model) == before
    assert not (tmp_path / "out" / REPORT_FILE).exists()


def test_liger_and_the_callback_together_are_refused(tmp_path, pm):
    # TrainingArguments(use_liger_kernel=True) needs liger-kernel installed, which CPU CI has not: the callback
    # is called with arguments that say so, as the Trainer would call it.
    model = tiny_causal_lm("qwen3")
    callback = KernelizeCallback(plugin_manager=pm)
    args = types.SimpleNamespace(use_liger_kernel=True, torch_compile=False, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="use_liger_kernel=True.*use one of them"):
        callback.on_train_begin(args, None, None, model=model)
    assert kernels_core.get_report(model) is None


def test_a_model_the_trainer_places_later_gets_kernels_for_the_training_device():
    """Under FSDP the Trainer leaves the model on the CPU until accelerate shards it onto the GPUs, after
    ``on_init_end``: the callback chooses kernels for ``args.device``, not for the CPU the parameters sit on.

    A test plugin reports two emulated CUDA devices and a CUDA RMSNorm kernel whose implementation is the core's
    reference (plain torch), so the choice is visible in the report on a CPU-only machine.
    """
    spec = KernelSpec(id="gpu.rms_norm.reference", kind="rms_norm", variants=("standard",), backend="cuda",
                      impl="kernels_core._kinds._reference:rms_norm", priority=90,
                      supports=Supports.BACKWARD | Supports.TORCH_COMPILE)
    gpus = kernels_core.BackendInfo(backend="cuda", device_type="cuda", priority=10,
                                    devices=(kernels_core.DeviceInfo(0, "emulated GPU"),
                                             kernels_core.DeviceInfo(1, "emulated GPU")))
    plugin = types.ModuleType("plugin_emulated_gpu")
    plugin.kernels_core_kernels = hookimpl(lambda: [spec])
    plugin.kernels_core_detect_devices = hookimpl(lambda: [gpus])
    pm = fresh_plugin_manager((plugin, "emulated_gpu"))
    model = tiny_causal_lm("qwen3")
    callback = KernelizeCallback(plugin_manager=pm)
    fsdp_rank1 = types.SimpleNamespace(device=torch.device("cuda", 1), use_liger_kernel=False, torch_compile=False)
    callback.on_init_end(fsdp_rank1, None, None, model=model)
    norms = [e for e in kernels_core.get_report(model).entries if e.kind == "rms_norm" and e.applied]
    assert norms and {(e.kernel, e.device) for e in norms} == {("gpu.rms_norm.reference", "cuda:1")}
    # On a CPU Trainer (and whenever the model already sits on its device) each module's own device decides.
    kernels_core.unkernelize(model)
    on_cpu = types.SimpleNamespace(device=torch.device("cpu"), use_liger_kernel=False, torch_compile=False)
    callback.on_init_end(on_cpu, None, None, model=model)
    norms = [e for e in kernels_core.get_report(model).entries if e.kind == "rms_norm" and e.applied]
    assert norms and all(e.device == "cpu" and not e.kernel.startswith("gpu.") for e in norms)


@pytest.mark.parametrize("how", ["cpu_ram_efficient_loading", "meta parameters"])
def test_weights_that_arrive_at_prepare_are_kernelized_when_training_begins(pm, caplog, how):
    """With FSDP's cpu_ram_efficient_loading only rank 0 holds weights when the Trainer is built (the others hold
    meta tensors until accelerate prepares the model): kernel choices, which check each module's math on its
    weights, wait for training to begin, so that every rank decides on the same weights."""
    model = tiny_causal_lm("qwen3")
    args = types.SimpleNamespace(device=torch.device("cpu"), use_liger_kernel=False, torch_compile=False,
                                 fsdp=["full_shard"] if how != "meta parameters" else [],
                                 fsdp_config={"cpu_ram_efficient_loading": True} if how != "meta parameters" else {},
                                 output_dir=None)
    init_model = model.to("meta") if how == "meta parameters" else model
    callback = KernelizeCallback(plugin_manager=pm)
    with caplog.at_level(logging.INFO, logger="transformers.trainer.kernels_core"):
        callback.on_init_end(args, None, None, model=init_model)
    assert kernels_core.get_report(init_model) is None
    assert "kernelizing when training begins" in caplog.text
    # accelerate has loaded (or broadcast) the weights by on_train_begin.
    prepared = tiny_causal_lm("qwen3")
    callback.on_train_begin(args, None, None, model=prepared)
    assert callback.report is not None
    assert {"rms_norm", "silu_gated_mlp", "causal_lm_loss"} <= {e.kind for e in callback.report.applied}
