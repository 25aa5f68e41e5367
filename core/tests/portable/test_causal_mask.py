"""``any.causal_mask.sdpa_is_causal``: no mask while tracing exactly where transformers returns none eagerly.

The stand-in for transformers' ``create_causal_mask`` always builds a mask, so every call that reaches it is
visible: the kernel must hand it every call except the unpadded, empty-cache, ``sdpa`` ones under tracing.
"""

from __future__ import annotations

import types

import pytest
import torch
from kernels_core._portable._causal_mask import sdpa_is_causal


def _build_mask(*args, inputs_embeds, **kwargs):
    size = inputs_embeds.shape[1]
    return torch.ones(size, size, dtype=torch.bool).tril()


class _Cache:
    def __init__(self, seen: int) -> None:
        self.seen = seen

    def get_seq_length(self) -> int:
        return self.seen


class _NoLength:
    """A cache-like object that cannot say how many tokens it holds."""


def _config(implementation: str = "sdpa", *, is_causal: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(_attn_implementation=implementation, is_causal=is_causal)


def _elidable_kwargs(x: torch.Tensor) -> dict:
    return {"config": _config(), "inputs_embeds": x, "attention_mask": None, "past_key_values": _Cache(0),
            "position_ids": torch.arange(x.shape[1])[None]}


def _mask_or_none_compiled(kwargs: dict) -> torch.Tensor | None:
    """What the kernel returns while Dynamo traces it (fullgraph: a graph break fails the test)."""
    torch._dynamo.reset()

    def run(x):
        mask = sdpa_is_causal(_build_mask, **{**kwargs, "inputs_embeds": x})
        return x.sum() if mask is None else mask.sum() + 1000

    x = kwargs["inputs_embeds"]
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    return None if out.item() < 1000 else out


def test_eager_calls_always_reach_transformers():
    x = torch.randn(1, 4, 8)
    assert torch.equal(sdpa_is_causal(_build_mask, **_elidable_kwargs(x)), _build_mask(inputs_embeds=x))


def test_compiled_unpadded_empty_cache_sdpa_has_no_mask():
    assert _mask_or_none_compiled(_elidable_kwargs(torch.randn(1, 4, 8))) is None


def test_compiled_without_cache_and_positions_has_no_mask():
    kwargs = {**_elidable_kwargs(torch.randn(1, 4, 8)), "past_key_values": None, "position_ids": None}
    assert _mask_or_none_compiled(kwargs) is None


@pytest.mark.parametrize("change", [
    pytest.param({"attention_mask": torch.ones(1, 4, dtype=torch.long)}, id="padding-mask-given"),
    pytest.param({"config": _config("eager")}, id="eager-attention-needs-the-mask"),
    pytest.param({"config": _config("flex_attention")}, id="flex-attention"),
    pytest.param({"config": _config(is_causal=False)}, id="bidirectional"),
    pytest.param({"past_key_values": _Cache(3)}, id="cache-holds-tokens"),
    pytest.param({"past_key_values": None}, id="no-cache-positions-may-be-packed"),
    pytest.param({"past_key_values": _NoLength()}, id="cache-without-a-length"),
    pytest.param({"or_mask_function": lambda *a: True}, id="extra-mask-function"),
    pytest.param({"allow_is_causal_skip": False}, id="skip-disallowed"),
    pytest.param({"some_future_argument": 1}, id="unknown-argument"),
])
def test_compiled_calls_that_need_a_mask_reach_transformers(change):
    kwargs = {**_elidable_kwargs(torch.randn(1, 4, 8)), **change}
    assert _mask_or_none_compiled(kwargs) is not None


def test_positional_calls_reach_transformers():
    x = torch.randn(1, 4, 8)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return "mask"

    assert sdpa_is_causal(spy, _config(), x, None, _Cache(0)) == "mask"
    assert calls


@pytest.mark.parametrize(("positions_derived", "change", "positions_reach_transformers"), [
    pytest.param(True, {"past_key_values": None}, False, id="derived-no-cache-not-checked"),
    pytest.param(False, {"past_key_values": None}, True, id="passed-by-the-caller-checked"),
    pytest.param(True, {"past_key_values": None, "attention_mask": torch.ones(1, 4, dtype=torch.long)}, True,
                 id="with-a-mask-unchanged"),
    pytest.param(True, {}, True, id="with-a-cache-unchanged"),
])
def test_eager_calls_give_transformers_only_positions_it_must_check(positions_derived, change,
                                                                      positions_reach_transformers):
    # Without a cache or mask transformers checks position ids for packed sequences, reading a device value;
    # the model's own 0..S-1 are never packed, so they are left out there and only there.
    seen = []

    def spy(**kwargs):
        seen.append(kwargs["position_ids"])
        return "mask"

    kwargs = {**_elidable_kwargs(torch.randn(1, 4, 8)), **change}
    assert sdpa_is_causal(spy, positions_derived=positions_derived, **kwargs) == "mask"
    assert (seen[0] is not None) == positions_reach_transformers
