"""The ``sliding_window_attention`` kind on real transformers models: what it matches, what it declines, and the
math of a kernelized model against the eager one (logits and gradients, padded and unpadded, compiled)."""

from __future__ import annotations

import copy

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("transformers")

KIND = "sliding_window_attention"


def _entries(model):
    return {e.module: e for e in kernels_core.get_report(model).entries if e.kind == KIND}


def _gemma3(**overrides):
    return tiny_causal_lm("gemma3_text", num_hidden_layers=3, sliding_window=3,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"], **overrides)


def test_sliding_layers_get_the_kernel_and_full_layers_are_not_matched():
    model = _gemma3()
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    entries = _entries(model)
    assert sorted(entries) == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    assert {e.kernel for e in entries.values()} == {"any.sliding_window_attention.banded"}
    kernels_core.unkernelize(model)
    assert "forward" not in model.model.layers[0].self_attn.__dict__


@pytest.mark.parametrize("padded", [False, True])
def test_loss_logits_and_gradients_match_eager(padded):
    model = _gemma3()
    eager = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    ids = torch.randint(3, 101, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        inputs["attention_mask"] = mask
    got, expected = model(**inputs), eager(**inputs)
    got.loss.backward()
    expected.loss.backward()
    assert_close(got.loss, expected.loss, dtype=torch.float32, what="loss")
    with torch.no_grad():
        model.eval()
        eager.eval()
        assert_close(model(**inputs).logits, eager(**inputs).logits, dtype=torch.float32, what="logits")
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, q.grad, dtype=torch.float32, factor=2.0, what=name)


def test_the_kernel_splits_the_square(monkeypatch):
    # Sliding layers call SDPA once per window of queries; the full-attention layer once on the whole sequence.
    lengths = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        lengths.append(query.shape[-2])
        return real(query, *args, **kwargs)

    model = _gemma3()
    kernels_core.kernelize(model, mode=Mode.INFERENCE)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 101, (1, 11)))
    assert lengths == [3, 3, 3, 2, 11, 3, 3, 3, 2]


def test_generate_matches_eager():
    model = _gemma3()
    model.config.use_cache = True
    eager = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=Mode.INFERENCE)
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, eager.generate(ids, max_new_tokens=6, do_sample=False))


def test_compiled_model_matches_eager():
    model = _gemma3()
    eager = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    ids = torch.randint(3, 101, (2, 13), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids).logits
        assert_close(got, eager(input_ids=ids).logits, dtype=torch.float32)


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"attn_implementation": "eager"}, "attention implementation is 'eager'"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
])
def test_declines_what_it_cannot_compute(overrides, reason):
    model = _gemma3(**overrides)
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    entries = _entries(model)
    assert entries, "the sliding layers are matched and declined, not ignored"
    for entry in entries.values():
        assert entry.kernel is None
        assert reason in entry.reason


def test_models_without_sliding_layers_are_not_matched():
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    assert not _entries(model)
