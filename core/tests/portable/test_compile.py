"""Every portable kernel declares ``Supports.TORCH_COMPILE``: each must trace with ``fullgraph=True``.

``aot_eager`` traces forward and backward through dynamo and AOTAutograd exactly as inductor would, without
spending a C++ compile on the test machine; graph breaks and untraceable autograd code fail here.
"""

from __future__ import annotations

import pytest
import torch
from kernels_core import Supports
from kernels_core._portable import SPECS
from kernels_core._portable._causal_mask import sdpa_is_causal
from kernels_core._portable._cross_entropy import fused_linear_cross_entropy
from kernels_core._portable._masked_attention import masked_attention
from kernels_core._portable._residual_rms_norm import residual_rms_norm
from kernels_core._portable._rms_norm import rms_norm
from kernels_core._portable._silu_mul import silu_mul
from kernels_core._portable._sliding_window import banded_sdpa


def _loss(hidden, weight, labels):
    return fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias=None,
        ignore_index=-100,
        num_items_in_batch=torch.tensor(30),
        softcap=20.0,
        chunk_size=16,
    )


class _EmptyCache:
    def get_seq_length(self) -> int:
        return 0


class _SdpaConfig:
    _attn_implementation = "sdpa"


def _transformers_5_17_mask(*, inputs_embeds, **kwargs):
    # Like transformers 5.17: no mask eagerly for unpadded inputs, a dense one while Dynamo traces.
    if not torch.compiler.is_compiling():
        return None
    size = inputs_embeds.shape[1]
    return torch.ones(size, size, dtype=torch.bool).tril()


def _masked_scores(x):
    mask = sdpa_is_causal(_transformers_5_17_mask, config=_SdpaConfig(), inputs_embeds=x, attention_mask=None,
                          past_key_values=_EmptyCache(), position_ids=None)
    scores = x @ x.transpose(-1, -2)
    return (scores if mask is None else scores.masked_fill(~mask, 0.0)).sum()


def _banded_attention(q, k, v):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    i = torch.arange(q.shape[-2])
    band = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - 3))[None, None]
    return banded_sdpa(sdpa_attention_forward, torch.nn.Module(), q, k, v, band, sliding_window=3)[0].sum()


def _packed_masked_attention(q, k, v):
    # Two documents of 4 and 7 tokens in one row; grouped-query heads (4 queries, 2 keys and values).
    i, document = torch.arange(11), torch.tensor([0] * 4 + [1] * 7)
    mask = ((i[:, None] >= i[None]) & (document[:, None] == document[None]))[None]
    return masked_attention(q, k, v, mask=mask, scale=0.3).sum()


CASES = {
    "packed_attention": (_packed_masked_attention, lambda: (torch.randn(2, 4, 11, 8), torch.randn(2, 2, 11, 8),
                                                           torch.randn(2, 2, 11, 8))),
    "sliding_window_attention": (_banded_attention, lambda: tuple(torch.randn(2, 2, 11, 8) for _ in range(3))),
    "causal_mask": (_masked_scores, lambda: (torch.randn(2, 5, 8),)),
    "causal_lm_loss": (_loss, lambda: (torch.randn(37, 8), torch.randn(50, 8), torch.randint(0, 50, (37,)))),
    "rms_norm": (
        lambda x, w: rms_norm(x, w, eps=1e-6, offset=1.0, casting="gemma").sum(),
        lambda: (torch.randn(2, 5, 8), torch.randn(8)),
    ),
    "silu_gated_mlp": (lambda g, u: silu_mul(g, u).sum(), lambda: (torch.randn(4, 8), torch.randn(4, 8))),
    "residual_rms_norm": (
        # Both outputs feed the loss, as in a decoder layer (the new residual is added to the MLP output).
        lambda x, r, w: sum(t.sum() * k for k, t in enumerate(
            residual_rms_norm(x, r, w, eps=1e-6, offset=0.0, casting="llama"), start=1)),
        lambda: (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(8)),
    ),
}


@pytest.mark.parametrize("spec", [s for s in SPECS if s.supports & Supports.TORCH_COMPILE], ids=lambda s: s.id)
def test_fullgraph_compile_forward_and_backward(spec):
    fn, make_inputs = CASES[spec.kind]
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in make_inputs()]
    floats = [t for t in inputs if t.requires_grad]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    actual = compiled(*inputs)
    actual_grads = torch.autograd.grad(actual, floats)
    expected = fn(*inputs)
    expected_grads = torch.autograd.grad(expected, floats)
    # aot_eager runs the same ATen ops, so results are identical.
    assert torch.equal(actual, expected)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert torch.equal(a, e)
