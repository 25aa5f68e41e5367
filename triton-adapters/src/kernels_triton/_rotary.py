"""Rotary position embedding (transformers' ``apply_rotary_pos_emb``, full and partial rotation): this package's
Triton kernel (q and k in one launch per direction), its ``autograd.Function`` and ``torch.library`` custom op,
the adapter over them and the adapter over Liger's kernel.

The kernel computes in float32, saves nothing for backward but the ``cos``/``sin`` it was given, writes new
tensors with the strides of q and k (the inputs are never modified) and handles partial rotation and
``unsqueeze_dim=2``. Liger's RoPE rotates its inputs in place whenever ``q.transpose(1, 2)`` is contiguous: its
adapter hands it a private copy then.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _native
from ._compile import inference_trace
from ._compile import tracing
from ._custom_op import custom_op
from ._custom_op import register_backward
from ._device import on_device_of
from ._launch import FLOATS
from ._launch import next_power_of_2


__all__ = ["liger_rotary_embedding", "rotary", "rotary_embedding", "rotary_launch", "rotary_op", "unit_last_stride"]


@triton.jit
def _rotate_heads(SRC, DST, b, s, n_heads, head_dim, s_b, s_h, s_s, o_b, o_h, o_s, a11, a12, a21, a22,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    h_mask = h < n_heads
    mask = h_mask[:, None] & (d < HALF)[None, :]
    src = SRC + b * s_b + s * s_s + h[:, None].to(tl.int64) * s_h
    dst = DST + b * o_b + s * o_s + h[:, None].to(tl.int64) * o_h
    x1 = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * a11[None, :] + x2 * a12[None, :]
    y2 = x1 * a21[None, :] + x2 * a22[None, :]
    tl.store(dst + d[None, :], y1.to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d[None, :], y2.to(DST.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        # Partial rotation: the dims past the rotated ones pass through unchanged.
        p = tl.arange(0, BLOCK_PASS)
        pass_mask = h_mask[:, None] & (p < head_dim - 2 * HALF)[None, :]
        rest = tl.load(src + 2 * HALF + p[None, :], mask=pass_mask, other=0.0)
        tl.store(dst + 2 * HALF + p[None, :], rest, mask=pass_mask)


@triton.jit(do_not_specialize=["n_seq", "n_q_heads", "n_k_heads", "head_dim", "sq_b", "sq_h", "sq_s", "sk_b",
                               "sk_h", "sk_s", "sqo_b", "sqo_h", "sqo_s", "sko_b", "sko_h", "sko_s", "sc_b", "sc_s"])
def _rotary_kernel(
    Q, K, COS, SIN, QO, KO, n_seq, n_q_heads, n_k_heads, head_dim,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s, sc_b, sc_s,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr, ALIGNED: tl.constexpr,
):
    # One program per (batch, position): all heads of q and k share that position's cos/sin.
    if ALIGNED:
        # Every stride is a multiple of 16 elements (checked at launch): lets the compiler vectorise along d.
        sq_b, sq_h, sq_s = tl.multiple_of(sq_b, 16), tl.multiple_of(sq_h, 16), tl.multiple_of(sq_s, 16)
        sk_b, sk_h, sk_s = tl.multiple_of(sk_b, 16), tl.multiple_of(sk_h, 16), tl.multiple_of(sk_s, 16)
        sqo_b, sqo_h, sqo_s = tl.multiple_of(sqo_b, 16), tl.multiple_of(sqo_h, 16), tl.multiple_of(sqo_s, 16)
        sko_b, sko_h, sko_s = tl.multiple_of(sko_b, 16), tl.multiple_of(sko_h, 16), tl.multiple_of(sko_s, 16)
        sc_b, sc_s = tl.multiple_of(sc_b, 16), tl.multiple_of(sc_s, 16)
    pid = tl.program_id(0)
    b = (pid // n_seq).to(tl.int64)
    s = (pid % n_seq).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    trig = b * sc_b + s * sc_s
    c1 = tl.load(COS + trig + d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + trig + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + trig + d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + trig + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    # Forward: [y1, y2] = [[c1, -s1], [s2, c2]] @ [x1, x2]; backward applies the transpose to the gradient.
    if BACKWARD:
        a11, a12, a21, a22 = c1, s2, -s1, c2
    else:
        a11, a12, a21, a22 = c1, -s1, s2, c2
    _rotate_heads(Q, QO, b, s, n_q_heads, head_dim, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s, a11, a12, a21, a22,
                  HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K, KO, b, s, n_k_heads, head_dim, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s, a11, a12, a21, a22,
                  HALF, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its last dimension is dense (what the RoPE kernel needs), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=256)
def _rotary_config(n_q_heads: int, n_k_heads: int, half: int, passthrough: int) -> tuple[int, int, int, int, int]:
    """(Q_HEADS, K_HEADS, HALF, PASSTHROUGH blocks, num_warps) of the RoPE launch for one head layout."""
    heads = max(n_q_heads, n_k_heads) * next_power_of_2(half)
    return (next_power_of_2(n_q_heads), next_power_of_2(n_k_heads), next_power_of_2(half),
            next_power_of_2(passthrough), 4 if heads <= 2048 else 8)


def rotary_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch rotating q and k (``backward``: by the inverse rotation, which is the gradient); new outputs."""
    batch, n_q_heads, n_seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    half = cos.shape[-1] // 2
    q_out = torch.empty_like(q)  # same strides as q, as eager's elementwise math gives
    k_out = torch.empty_like(k)
    q_block, k_block, half_block, passthrough_block, num_warps = _rotary_config(
        n_q_heads, n_k_heads, half, head_dim - 2 * half)
    cos_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    strides = (*q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3], cos_batch_stride,
               cos.stride(1))
    _rotary_kernel[(batch * n_seq,)](
        q, k, cos, sin, q_out, k_out, n_seq, n_q_heads, n_k_heads, head_dim, *strides,
        half, q_block, k_block, half_block, passthrough_block, backward,
        half % 8 == 0 and all(stride % 16 == 0 for stride in strides), num_warps=num_warps,
    )
    return q_out, k_out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary_launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rotary_launch(unit_last_stride(dq), unit_last_stride(dk), cos, sin, backward=True)
        return dq_in, dk_in, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """Rotate-half RoPE over the first ``cos.shape[-1]`` dims of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]``.

    ``cos``/``sin`` are ``[B or 1, S, R]`` with a unit last stride; q and k need a unit last stride. New tensors
    are returned (the inputs are never modified) with the strides of q and k.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin)
    return rotary_launch(q, k, cos, sin, backward=False)


# --------------------------------------------------------------------------------------------------- custom op


# The kernel writes outputs with the strides of the q and k it reads (empty_like keeps a dense layout's strides).
@custom_op("rotary", fake=lambda q, k, *_: tuple(torch.empty_like(unit_last_stride(t)) for t in (q, k)))
def _rotary_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dense = unit_last_stride
    return rotary_launch(dense(q), dense(k), dense(cos), dense(sin), backward)


# The gradient is the inverse rotation: the same op with backward=True.
register_backward(_rotary_op, save=lambda inputs, output: (inputs[2:4], ()),
                  grad=lambda saved, dq, dk: (*_rotary_op(dq, dk, *saved, True), None, None, None))


def rotary_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """:func:`rotary` through the custom op (same arguments, same result), for graphs Dynamo traces."""
    return _rotary_op(q, k, cos, sin, False)


# ----------------------------------------------------------------------------------------------------- adapters


def _rotary_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    if not (q.is_cuda and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and unsqueeze_dim in (1, 2)):
        return False
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    rotary_dim = cos.shape[-1]
    return (
        q.dtype == k.dtype == cos.dtype == sin.dtype  # another cos/sin dtype promotes the output in eager
        and q.dtype in FLOATS
        and cos.shape == sin.shape
        and cos.shape[0] in (1, q.shape[0])
        and cos.shape[1] == q.shape[seq_dim] == k.shape[seq_dim]
        and k.shape[0] == q.shape[0]
        and rotary_dim % 2 == 0
        and 0 < rotary_dim <= q.shape[-1] == k.shape[-1]
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
        and not (cos.requires_grad or sin.requires_grad)
    )


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (full or partial rotation) with one launch for q and k.

    The inputs are never modified; the outputs have the strides of q and k. ``unsqueeze_dim=2`` (``[B, S, H, D]``
    layouts) is handled by viewing q and k as ``[B, H, S, D]``.

    Example:
        >>> q = k = torch.randn(1, 2, 3, 4)
        >>> out = rotary_embedding(q, k, torch.ones(1, 3, 4), torch.zeros(1, 3, 4))  # CPU: native path
        >>> torch.equal(out[0], q)
        True
    """
    if not _rotary_ok(q, k, cos, sin, unsqueeze_dim) or inference_trace(q, k):
        return _native.rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    _rotary = rotary_op if tracing() else rotary
    with on_device_of(q):
        if unsqueeze_dim == 2:
            q_out, k_out = _rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return _rotary(q, k, cos, sin)


def _private_copy(x: torch.Tensor) -> torch.Tensor:
    # Liger rotates in place whenever x.transpose(1, 2) is contiguous (the usual [B, S, H, D] projection layout).
    # The calling convention returns new tensors like eager does, so give Liger a copy of its own then; in the
    # other layouts Liger's own .contiguous() already copies.
    if x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).clone().transpose(1, 2)
    return x


def liger_rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` with ``LigerRopeFunction``; the inputs are never modified.

    Partial rotation (``cos.shape[-1] < head_dim``) is handled by Liger >= 0.8.5's ``rotary_dim``. Layouts Liger
    does not take (``unsqueeze_dim != 1``, cos/sin in another dtype, which promotes in eager) use the native math.

    Example:
        >>> q = k = torch.randn(1, 2, 3, 4)
        >>> out = liger_rotary_embedding(q, k, torch.ones(1, 3, 4), torch.zeros(1, 3, 4))  # CPU: native path
        >>> torch.equal(out[0], q)
        True
    """
    usable = (
        q.is_cuda
        and not tracing()
        and unsqueeze_dim == 1
        and q.dim() == 4
        and cos.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= q.shape[-1]
    )
    if not usable:
        return _native.rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    from liger_kernel.ops import LigerRopeFunction

    with on_device_of(q):
        return LigerRopeFunction.apply(_private_copy(q), _private_copy(k), cos, sin, None, 1, cos.shape[-1])
