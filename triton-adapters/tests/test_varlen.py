"""``native_varlen_attention`` (packed_attention kind): the same attention as the core's portable kernel and as
dense-mask SDPA, forward and backward. On the CPU every input goes to the portable kernel; the FlashAttention
path is checked on a GPU (bf16 and fp16, grouped-query heads, sliding windows, odd document lengths)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from kernels_core.portable import packed_attention
from kernels_triton import ops


LENGTHS = (37, 1, 130, 64, 255)
EQUAL = (96, 96, 96)  # one dense causal batch through SDPA (a window of 50 cuts them: FlashAttention varlen)


def _dense(query, key, value, lengths, *, scale, window):
    """SDPA over the whole packed row with the dense per-document mask transformers would build."""
    document = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(query.device)
    index = torch.arange(len(document), device=query.device)
    distance = index[:, None] - index[None]
    mask = (document[:, None] == document[None]) & (distance >= 0)
    if window is not None:
        mask &= distance < window
    q, k, v = (t.transpose(0, 1)[None].float() for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _inputs(device, dtype, heads=(8, 2), dim=64, lengths=LENGTHS):
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads[0], dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(total, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(total, heads[1], dim, device=device, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def _check(device, dtype, *, window, heads=(8, 2), lengths=LENGTHS):
    q, k, v, cu = _inputs(device, dtype, heads, lengths=lengths)
    scale = q.shape[-1] ** -0.5
    out = ops.native_varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), scale=scale, window=window)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    reference = _dense(q, k, v, lengths, scale=scale, window=window)
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    # float32 reference: the kernel's error is one rounding of its output (bf16: 2^-8 relative) plus accumulation
    # order; gradients through the softmax get a few roundings more.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("lengths", [LENGTHS, EQUAL], ids=["mixed", "equal"])
@pytest.mark.parametrize("window", [None, 50])
def test_cpu_goes_to_the_portable_kernel(window, lengths):
    _check("cpu", torch.float32, window=window, lengths=lengths)
    q, k, v, cu = _inputs("cpu", torch.float32)
    scale = q.shape[-1] ** -0.5
    torch.testing.assert_close(
        ops.native_varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=255, scale=scale, window=None),
        packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=255, scale=scale, window=None), atol=0, rtol=0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 50], ids=["causal", "window50"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("lengths", [LENGTHS, EQUAL], ids=["mixed", "equal"])
def test_gpu_flash_varlen(dtype, window, heads, lengths):
    _check("cuda", dtype, window=window, heads=heads, lengths=lengths)


@requires_cuda
@pytest.mark.parametrize("window", [None, 96, 50], ids=["causal", "window-covers", "window-cuts"])
def test_gpu_equal_documents_route(monkeypatch, window):
    """Equal documents that no window cuts are one dense SDPA call; a window that cuts them keeps FlashAttention's
    varlen kernel, which takes the window itself."""
    import kernels_triton._varlen as varlen

    routed = []
    monkeypatch.setattr(varlen, "packed_attention", lambda *a, **k: routed.append(1) or packed_attention(*a, **k))
    q, k, v, cu = _inputs("cuda", torch.bfloat16, lengths=EQUAL)
    ops.native_varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=96, scale=0.125, window=window)
    assert routed == ([] if window == 50 else [1])
