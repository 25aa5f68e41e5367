"""Shared pieces of the trainer-integration tests: a token dataset made in code and per-step loss comparison."""

from __future__ import annotations

import torch


VOCAB = 101  # kernels_core.testing.tiny_causal_lm's vocabulary


def token_dataset(n: int = 48, length: int = 12, *, seed: int = 0,
                  ragged: bool = False) -> list[dict[str, torch.Tensor]]:
    """Random sequences with labels; ``ragged`` gives lengths 6..length and masks the first two labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        size = int(torch.randint(6, length + 1, (), generator=g)) if ragged else length
        ids = torch.randint(3, VOCAB, (size,), generator=g)
        labels = ids.clone()
        if ragged:
            labels[:2] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def pad_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def step_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_losses_equal(actual: list[float], expected: list[float], *, rtol: float = 1e-4, what: str = "") -> None:
    """Per-step losses agree to ``rtol`` (fp32 on CPU: the fused loss differs from eager by reduction order)."""
    assert len(actual) == len(expected) > 0, f"{what}: {len(actual)} logged losses vs {len(expected)}"
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))
    assert worst <= rtol, f"{what}: losses differ by {worst:.2e} relative (> {rtol:.0e}): {actual} vs {expected}"


def word_tokenizer():
    """A whitespace word-level tokenizer over tiny_causal_lm's 101 ids (``w3`` .. ``w100``), made in code."""
    from tokenizers import Tokenizer
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def words(generator: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=generator))


def assert_logs_equal(actual: list[dict], expected: list[dict], keys: tuple[str, ...], *, rtol: float = 1e-4) -> None:
    """Every per-step log entry has ``keys`` and they agree to ``rtol`` (plus 1e-6 absolute, for values near 0)."""
    steps_a = [e for e in actual if "loss" in e]
    steps_e = [e for e in expected if "loss" in e]
    assert len(steps_a) == len(steps_e) > 0
    for step, (a, e) in enumerate(zip(steps_a, steps_e, strict=True)):
        for key in keys:
            assert key in a and key in e, f"step {step}: metric {key!r} missing ({sorted(a)})"
            assert abs(a[key] - e[key]) <= rtol * abs(e[key]) + 1e-6, f"step {step}: {key} {a[key]} vs {e[key]}"
