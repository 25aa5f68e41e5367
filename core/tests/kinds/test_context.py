"""Probe helpers: random draws of a probe come from its own generator, never from torch's process-wide ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernels_core._kinds._context import ProbeRandomness


def _draws(seed: int) -> list[torch.Tensor]:
    """One call of each kind of random function a forward may make, under a probe generator seeded ``seed``."""
    x = torch.ones(4, 6)
    with ProbeRandomness(torch.Generator().manual_seed(seed)):
        return [
            torch.rand(3), torch.randn(3), torch.randint(0, 100, (3,)), torch.randperm(7), torch.rand_like(x),
            torch.bernoulli(torch.full((5,), 0.5)), torch.empty(5).uniform_(), torch.empty(5).normal_(),
            torch.nn.init.kaiming_uniform_(torch.empty(3, 4)), F.dropout(x, 0.5), torch.nn.Dropout(0.3)(x),
            F.dropout(x.clone(), 0.5, inplace=True), torch.dropout(x, 0.5, True), torch.dropout(x, p=0.5, train=True),
            F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None], dropout_p=0.5),
        ]


def test_probe_draws_are_reproducible_and_leave_the_global_generator_untouched():
    state = torch.get_rng_state()
    first, again, other = _draws(0), _draws(0), _draws(1)
    assert torch.equal(torch.get_rng_state(), state), "a probe drew from or reseeded the global generator"
    for index, (a, b, c) in enumerate(zip(first, again, other, strict=True)):
        assert torch.equal(a, b), f"draw {index} differs under the same probe seed"
        assert not torch.equal(a, c), f"draw {index} ignores the probe's generator"


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_attention_dropout_is_sdpas_math_with_the_probes_masks(mask):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query attention: 2 key/value heads for 4 query heads
    masks = {None: None, "bool": torch.rand(5, 5, generator=gen) > 0.3, "float": torch.randn(5, 5, generator=gen)}
    attn_mask = masks[mask]
    if mask == "bool":
        attn_mask.fill_diagonal_(True)  # no fully masked row
    with ProbeRandomness(torch.Generator().manual_seed(0)):
        actual = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.25, enable_gqa=True)
    # SDPA's own math with the same masks: its dropout_mask argument exists for exactly this comparison. It adds
    # the mask as it is, so a boolean one goes in as SDPA's front end hands it on (-inf where False).
    keep = torch.rand(2, 4, 5, 5, generator=torch.Generator().manual_seed(0)) >= 0.25
    additive = torch.zeros(5, 5).masked_fill(~attn_mask, float("-inf")) if mask == "bool" else attn_mask
    expected = torch.ops.aten._scaled_dot_product_attention_math(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), additive, 0.25, dropout_mask=keep)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    with ProbeRandomness(torch.Generator().manual_seed(0)):
        causal = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True, enable_gqa=True)
    expected = torch.ops.aten._scaled_dot_product_attention_math(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), None, 0.25, True, dropout_mask=keep)[0]
    torch.testing.assert_close(causal, expected, rtol=1e-5, atol=1e-6)
