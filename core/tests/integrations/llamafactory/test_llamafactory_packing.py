"""Packed rows in LLaMA-Factory 0.9.5, with the kernels_core plugin and without it.

What reaches the model (read from llamafactory 0.9.5's source):

- v1 ``batching_strategy: padding_free`` refuses any attention but ``flash_attention_2`` (``BaseTrainer``); v1's
  default is sdpa.
- v1 ``batching_strategy: dynamic_padding_free`` packs the samples of a micro batch into one row with restarting
  ``position_ids`` and an all-ones 2-D ``attention_mask`` (``_pack_padding_free_samples``). Given a mask,
  transformers' sdpa does not look for packed rows: eager attends across the documents of the row, so the
  packed-attention kernel must not run, and does not.
- v0 ``neat_packing`` (``SFTDataCollatorWith4DAttentionMask`` with ``block_diag_attn``, any attention but
  flash_attention_2) turns segment ids into a 4-D additive mask, causal per document: the kernel computes those
  rows, unless the row ends in padding, whose queries see no key (the mask is then no longer causal per document and
  goes to sdpa as before).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import kernels_core
import kernels_core.integrations.llamafactory  # noqa: F401  (registers KernelPlugin("kernels_core"))
import pytest
import torch
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager


LAYERS = 2  # save_tiny_chat_model's decoder layers


def _sft(model_dir, dataset, kernel_config, output_dir, **extra):
    """LLaMA-Factory v1's run_sft, keeping the trainer and the row lengths the backbone got."""
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.trainers.sft_trainer import SFTTrainer

    args = {"model": str(model_dir), "template": "chatml", "train_dataset": str(dataset),
            "output_dir": str(output_dir), "micro_batch_size": 4, "global_batch_size": 8, "cutoff_len": 64,
            "learning_rate": 1e-3, "max_steps": 2, "batching_workers": 0, "seed": 0, **extra}
    if kernel_config is not None:
        args["kernel_config"] = kernel_config
    model_args, data_args, training_args, _ = get_args(args)
    DistributedInterface(training_args.dist_config)
    engine = ModelEngine(model_args, is_train=True)
    rows: list[tuple[list[int], bool]] = []

    def record(module, call_args, kwargs):
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        for row in positions:
            starts = (row == 0).nonzero().flatten().tolist() + [row.numel()]
            rows.append([b - a for a, b in zip(starts[:-1], starts[1:], strict=True)])
        assert mask is not None and mask.dim() == 2 and bool(mask.all())  # LLaMA-Factory's all-ones mask

    engine.model.base_model.register_forward_pre_hook(record, with_kwargs=True)
    trainer = SFTTrainer(args=training_args, model=engine.model, renderer=engine.renderer,
                         train_dataset=DataEngine(data_args.train_dataset))
    return trainer, engine.model, rows


# LLaMA-Factory's batching uses torchdata 0.11's StatefulDataLoader, which on torch 2.13's CPU build warns about
# torch.set_vital and pin_memory_device (deprecated) and pinned memory without an accelerator.
@pytest.mark.filterwarnings("ignore::UserWarning:torchdata")
@pytest.mark.filterwarnings("ignore::UserWarning:torch.utils.data")
def test_v1_dynamic_padding_free_matches_eager(tiny_model_dir, tiny_dataset, use_pm, sdpa_calls, tmp_path):
    use_pm(fresh_plugin_manager())
    runs = {}
    for which, config in (("eager", None), ("kernels", {"name": "kernels_core"})):
        trainer, model, rows = _sft(tiny_model_dir, tiny_dataset, config, tmp_path / which,
                                    batching_strategy="dynamic_padding_free")
        sdpa_calls.clear()
        trainer.fit()
        runs[which] = ([entry["loss"] for entry in trainer.state.log_history], model, rows, list(sdpa_calls))
    (eager_losses, _, eager_rows, eager_calls), (losses, model, rows, calls) = runs["eager"], runs["kernels"]
    assert rows == eager_rows and all(len(row) > 1 for row in rows), "rows of several documents each"
    assert len(losses) == len(eager_losses) == 2
    for kernel, eager in zip(losses, eager_losses, strict=True):
        assert abs(kernel - eager) <= 1e-5 * abs(eager), (losses, eager_losses)
    report = kernels_core.get_report(model)
    assert sum(e.kind == "packed_attention" and e.applied for e in report.entries) == LAYERS, report.summary()
    # The all-ones mask makes eager one causal call over each whole row (forward, then again in backward under
    # LLaMA-Factory's default activation checkpointing): no per-document call, with the kernel bound or not.
    whole_rows = sorted(sum(row) for row in rows for _ in range(2 * LAYERS))
    assert sorted(eager_calls) == sorted(calls) == whole_rows


def test_v1_padding_free_needs_flash_attention(tiny_model_dir, tiny_dataset, use_pm, tmp_path):
    use_pm(fresh_plugin_manager())
    with pytest.raises(ValueError, match="`padding_free` requires `flash_attn: flash_attention_2`"):
        _sft(tiny_model_dir, tiny_dataset, {"name": "kernels_core"}, tmp_path / "out",
             batching_strategy="padding_free")


def _prepare_4d_attention_mask():
    """LLaMA-Factory's own ``llamafactory.data.collator.prepare_4d_attention_mask``, read from its source: importing
    that module imports peft, which this venv (LLaMA-Factory v1's pins) does not hold."""
    path = Path(importlib.util.find_spec("llamafactory").origin).parent / "data" / "collator.py"
    tree = ast.parse(path.read_text())
    (function,) = [node for node in tree.body
                   if isinstance(node, ast.FunctionDef) and node.name == "prepare_4d_attention_mask"]
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["prepare_4d_attention_mask"]


def _neat_packing_batch(lengths: tuple[int, ...], padding: int, vocab: int) -> dict[str, torch.Tensor]:
    """A v0 neat_packing row: segment ids 1..N (0 for padding) expanded by LLaMA-Factory's own function."""
    prepare_4d_attention_mask = _prepare_4d_attention_mask()
    segments = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(padding)])[None]
    ids = torch.randint(3, vocab, segments.shape, generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(padding, dtype=torch.long)])[None]
    labels = torch.where(segments > 0, ids, -100)
    return {"input_ids": ids, "attention_mask": prepare_4d_attention_mask(segments.long(), torch.float32),
            "position_ids": positions, "labels": labels}


@pytest.mark.parametrize("padding", [0, 3], ids=["full-row", "trailing-padding"])
def test_v0_neat_packing_mask(tiny_model_dir, sdpa_calls, padding):
    from transformers import AutoModelForCausalLM

    lengths = (5, 9, 3, 7)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    kernelized = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    kernels_core.kernelize(kernelized, plugin_manager=fresh_plugin_manager())
    batch = _neat_packing_batch(lengths, padding, eager.config.vocab_size)
    sdpa_calls.clear()
    expected = eager(**batch)
    assert sdpa_calls == []  # eager: the dense mask
    got = kernelized(**batch)
    # The kernel runs where the mask is causal per document; a padding query sees nothing, so not with padding.
    assert sdpa_calls == ([] if padding else list(lengths) * LAYERS)
    assert_close(got.loss, expected.loss, what="loss")
    got.loss.backward(), expected.loss.backward()
    grads = dict(eager.named_parameters())
    for name, param in kernelized.named_parameters():
        assert_close(param.grad, grads[name].grad, what=f"grad {name}")
