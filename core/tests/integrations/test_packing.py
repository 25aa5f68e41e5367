"""Packed rows where people pack them: the transformers Trainer with ``DataCollatorWithFlattening`` and TRL's
SFTTrainer with ``padding_free`` (with and without packing). Each runs three times from the same seed in float32 on
the CPU (plain, with ``KernelizeCallback``, with a model kernelized before the trainer) and every logged step must
agree (1e-4 relative).

What eager transformers computes decides what the kernelized model must compute. Its sdpa attention masks per
document only where it looks for packed rows: position ids given, no attention mask and no cache. The Trainer sets
the model's ``config.use_cache`` from ``TrainingArguments.use_cache`` (default False): False gives per-document
attention, True a cache and attention across the documents of a row. TRL's SFTTrainer passes ``use_cache=False``
with every batch, so its padding-free rows are always per document. Where eager is per document, the
``packed_attention`` kernel must be bound and must run: the core's portable kernel makes one causal, unmasked SDPA
call per document (one for the row where its documents all have one length), which a spy on
``torch.nn.functional.scaled_dot_product_attention`` sees; eager makes none (it passes the dense mask). Where
eager attends across documents, the only causal unmasked calls are transformers' own, one per row.
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from _trainer_helpers import assert_logs_equal
from _trainer_helpers import token_dataset
from _trainer_helpers import word_tokenizer
from _trainer_helpers import words
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")
from kernels_core.integrations.transformers import KernelizeCallback  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402


LAYERS = 2  # tiny_causal_lm's decoder layers
DISABLED = {"kinds": {"packed_attention": {"enabled": False}}}


def _record_documents(model) -> list[list[int]]:
    """The document lengths of every row the backbone gets, one list per row, in forward order (read off the
    restarting position ids the collators give)."""
    rows: list[list[int]] = []

    def hook(module, args, kwargs):
        positions = kwargs.get("position_ids")
        assert positions is not None, "the collator gave no position ids: these rows are not packed"
        for row in positions:
            starts = (row == 0).nonzero().flatten().tolist() + [row.numel()]
            rows.append([b - a for a, b in zip(starts[:-1], starts[1:], strict=True)])

    model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


def _per_document_calls(rows: list[list[int]], *, checkpointing: bool = False) -> list[int]:
    """The SDPA calls the portable packed-attention kernel makes: every layer, one per document of the row, or one
    for the whole row where its documents all have one length (a batch of them); under gradient checkpointing every
    layer runs again in backward. Both collators give one row a batch, so a row is what one kernel call sees."""
    return [length for row in rows for _ in range(LAYERS * (2 if checkpointing else 1))
            for length in (row[:1] if len(set(row)) == 1 else row)]


def _whole_row_calls(rows: list[list[int]]) -> list[int]:
    """transformers' own causal calls with a cache: every layer, one per row."""
    return [sum(row) for row in rows for _ in range(LAYERS)]


def _prepare(how: str, model, config: dict | None = None) -> list:
    if how == "before":
        kernels_core.kernelize(model, plugin_manager=fresh_plugin_manager(), config=config)
    return [KernelizeCallback(plugin_manager=fresh_plugin_manager(), config=config)] if how == "callback" else []


def _packed_attention_bound(model) -> int:
    report = kernels_core.get_report(model)
    return sum(1 for e in report.entries if e.kind == "packed_attention" and e.applied) if report else 0


# --- transformers Trainer + DataCollatorWithFlattening ---------------------------------------------------------------


def _flattening_dataset() -> list[dict[str, list[int]]]:
    # Lengths 6..12 with two masked labels each: DataCollatorWithFlattening keeps each row's own labels and masks
    # the first token of every document, so the loss counts differ per batch (a wrong normalisation would show).
    return [{"input_ids": r["input_ids"].tolist(), "labels": r["labels"].tolist()}
            for r in token_dataset(32, ragged=True)]


def _train_flattened(tmp_path, how: str, *, flash_kwargs: bool, use_cache: bool, sdpa_calls: list[int],
                     config: dict | None = None):
    model = tiny_causal_lm("qwen3")
    callbacks = _prepare(how, model, config)
    rows = _record_documents(model)
    args = TrainingArguments(output_dir=str(tmp_path / how), per_device_train_batch_size=4, max_steps=4,
                             logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0,
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, use_cache=use_cache)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=_flattening_dataset(), data_collator=collator,
                      callbacks=callbacks)
    assert model.config.use_cache is use_cache  # the Trainer sets it from its arguments
    sdpa_calls.clear()
    trainer.train()
    return trainer, model, rows, list(sdpa_calls)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "use-cache"])
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "flash-attn-kwargs"])
def test_trainer_with_flattening_collator_matches_eager(tmp_path, sdpa_calls, flash_kwargs, use_cache):
    plain, _, plain_rows, plain_calls = _train_flattened(tmp_path, "plain", flash_kwargs=flash_kwargs,
                                                         use_cache=use_cache, sdpa_calls=sdpa_calls)
    assert all(len(row) > 1 for row in plain_rows), "every row should hold several documents"
    # Eager: per document through a dense mask (no unmasked causal call), or across documents through a cache.
    assert plain_calls == ([] if not use_cache else _whole_row_calls(plain_rows))
    for how in ("callback", "before"):
        trainer, model, rows, calls = _train_flattened(tmp_path, how, flash_kwargs=flash_kwargs,
                                                       use_cache=use_cache, sdpa_calls=sdpa_calls)
        assert_logs_equal(trainer.state.log_history, plain.state.log_history, ("loss", "grad_norm"))
        assert rows == plain_rows
        assert _packed_attention_bound(model) == LAYERS, kernels_core.get_report(model).summary()
        if use_cache:
            # The cache lets every token see the earlier documents of its row: no mask reaches attention, the
            # kernel never runs, transformers' causal call over the whole row does.
            assert calls == _whole_row_calls(rows), how
        else:
            # Gradient checkpointing (where the Trainer turns it on) runs every layer again in backward.
            assert calls == _per_document_calls(rows, checkpointing=model.is_gradient_checkpointing), how


def test_spy_tells_the_packed_kernel_from_eager(tmp_path, sdpa_calls):
    """With the kind disabled the same run matches eager too, and the spy sees none of the kernel's calls: the
    per-document assertion above holds only because the packed kernel ran."""
    plain, _, _, _ = _train_flattened(tmp_path, "plain", flash_kwargs=False, use_cache=False, sdpa_calls=sdpa_calls)
    trainer, model, rows, calls = _train_flattened(tmp_path, "callback", flash_kwargs=False, use_cache=False,
                                                   sdpa_calls=sdpa_calls, config=DISABLED)
    assert_logs_equal(trainer.state.log_history, plain.state.log_history, ("loss", "grad_norm"))
    assert _packed_attention_bound(model) == 0
    assert calls == [] != _per_document_calls(rows)


# --- TRL SFTTrainer, padding_free ------------------------------------------------------------------------------------


REASON = "needs kernels-core's trl extra (nox -s \"tests(vendor='integrations')\" installs it)"
SFT_METRICS = ("loss", "mean_token_accuracy", "entropy", "grad_norm")


def _train_sft(tmp_path, how: str, *, packing: bool, sdpa_calls: list[int]):
    trl = pytest.importorskip("trl", reason=REASON)
    datasets = pytest.importorskip("datasets", reason=REASON)
    model = tiny_causal_lm("qwen3")
    callbacks = _prepare(how, model)
    rows = _record_documents(model)
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_list([{"text": words(g, int(torch.randint(4, 14, (), generator=g)))}
                                       for _ in range(32)])
    # padding_free alone requires max_length=None (TRL does not truncate unpacked padding-free rows); packing
    # (best-fit decreasing, TRL's default strategy) packs documents into rows of at most max_length tokens.
    config = trl.SFTConfig(output_dir=str(tmp_path / how), per_device_train_batch_size=4 if not packing else 2,
                           max_steps=4, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0,
                           use_cpu=True, bf16=False, disable_tqdm=True, padding_free=True, packing=packing,
                           max_length=32 if packing else None)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=word_tokenizer(),
                             callbacks=callbacks)
    sdpa_calls.clear()
    trainer.train()
    return trainer, model, rows, list(sdpa_calls)


@pytest.mark.parametrize("packing", [True, False], ids=["packing", "padding-free-only"])
def test_trl_sft_padding_free_matches_eager(tmp_path, sdpa_calls, packing):
    plain, _, plain_rows, plain_calls = _train_sft(tmp_path, "plain", packing=packing, sdpa_calls=sdpa_calls)
    # TRL flattens each batch into one row and passes use_cache=False: eager is per document, by a dense mask.
    assert plain_rows and all(len(row) > 1 for row in plain_rows)
    assert plain_calls == []
    # SFTConfig turns gradient checkpointing on by default: each layer's attention runs again in backward.
    assert plain.args.gradient_checkpointing
    for how in ("callback", "before"):
        trainer, model, rows, calls = _train_sft(tmp_path, how, packing=packing, sdpa_calls=sdpa_calls)
        assert_logs_equal(trainer.state.log_history, plain.state.log_history, SFT_METRICS)
        assert rows == plain_rows
        assert _packed_attention_bound(model) == LAYERS, kernels_core.get_report(model).summary()
        assert calls == _per_document_calls(rows, checkpointing=True), how
