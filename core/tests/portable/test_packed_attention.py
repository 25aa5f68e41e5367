"""The portable ``packed_attention`` kernel against SDPA under the dense per-document mask transformers builds,
forward and backward: documents of mixed and of equal lengths (one dense causal batch), grouped-query heads, sliding
windows shorter and longer than the documents, float32 and bfloat16 on the CPU."""

from __future__ import annotations

import pytest
import torch
from kernels_core.portable import document_bounds
from kernels_core.portable import equal_documents
from kernels_core.portable import packed_attention


MIXED = (5, 1, 12, 7)
EQUAL = (9, 9, 9)


def _dense(query, key, value, lengths, *, scale, window):
    document = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    index = torch.arange(len(document))
    distance = index[:, None] - index[None]
    mask = (document[:, None] == document[None]) & (distance >= 0)
    if window is not None:
        mask &= distance < window
    q, k, v = (t.transpose(0, 1)[None].double() for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _inputs(lengths, dtype, heads=(4, 2), dim=8):
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=generator).to(dtype).requires_grad_()
               for h in (heads[0], heads[1], heads[1]))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


# float64 reference. float32: accumulation order only. bfloat16: one rounding of each input product and of the
# output (2^-8 relative), a few more through the softmax's backward.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 4, 64], ids=["causal", "window4", "window64"])
@pytest.mark.parametrize("lengths", [MIXED, EQUAL], ids=["mixed", "equal"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_matches_dense_mask_forward_and_backward(dtype, window, lengths, heads):
    q, k, v, cu = _inputs(lengths, dtype, heads)
    scale = 8 ** -0.5
    out = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), scale=scale, window=window)
    reference = _dense(q, k, v, lengths, scale=scale, window=window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)
    grads = torch.autograd.grad(out.double().square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=4 * tol, rtol=4 * tol)


def test_equal_documents_take_one_sdpa_call(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    q, k, v, cu = _inputs(EQUAL, torch.float32)
    batched = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=9, scale=0.3, window=None)
    assert calls == [(3, 4, 9, 8)]
    # A max_seqlen above the longest document is still the convention's bound; the documents then go one by one
    # and give the same attention.
    calls.clear()
    one_by_one = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=10, scale=0.3, window=None)
    assert calls == [(1, 4, 9, 8)] * 3
    torch.testing.assert_close(batched, one_by_one, atol=1e-6, rtol=1e-6)


def test_equal_documents_is_read_from_shapes():
    q = torch.empty(12, 2, 4)
    assert equal_documents(q, torch.tensor([0, 4, 8, 12], dtype=torch.int32), 4)
    assert not equal_documents(q, torch.tensor([0, 2, 8, 12], dtype=torch.int32), 6)
    assert not equal_documents(q, torch.tensor([0, 12], dtype=torch.int32), 13)
    assert not equal_documents(torch.empty(0, 2, 4), torch.tensor([0], dtype=torch.int32), 0)


def test_no_documents_give_an_empty_output():
    q = torch.empty(0, 2, 4)
    out = packed_attention(q, q, q, cu_seqlens=torch.tensor([0], dtype=torch.int32), max_seqlen=0, scale=1.0,
                           window=None)
    assert out.shape == (0, 2, 4)


def test_document_bounds_are_read_once_per_tensor_and_again_after_a_write(monkeypatch):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or original(self))
    assert document_bounds(cu) == [0, 3, 8]
    assert document_bounds(cu) == [0, 3, 8]
    assert len(reads) == 1  # kept on the tensor: every layer of a forward shares it
    cu[1] = 5  # written in place: what was kept no longer describes it
    assert document_bounds(cu) == [0, 5, 8]
    assert len(reads) == 2
