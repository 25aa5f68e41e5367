"""Gated activations for SwiGLU and GeGLU MLPs (``act(gate) * up``, SiLU or GELU-tanh): this package's Triton
kernels (one launch per direction), their ``autograd.Function`` and ``torch.library`` custom ops, the adapters over
them and the adapters over Liger's fused kernels. The kernels take gate and up as two tensors or as the halves of
one concatenated ``[gate | up]`` projection (the MoE experts' layout), whose gradient they then write in one piece.

Only gate and up are saved for backward; eagerly their storage then receives the gradients, as Liger does, but
only for intermediate tensors, and their version is bumped so any other reader raises.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._compile import inference_trace
from ._compile import tracing
from ._custom_op import custom_op
from ._custom_op import dense_like
from ._custom_op import register_backward
from ._device import on_device_of
from ._launch import FLOATS
from ._launch import cdiv


__all__ = ["gate_up_activation", "gated_activation", "gated_backward", "gated_forward", "gated_op", "gelu_tanh_mul",
           "liger_gelu_tanh_mul", "liger_silu_mul", "silu_mul"]


@triton.jit
def _tanh(x):
    # tanh through exp2, stable for large |x| (exp2 of a non-positive argument never overflows).
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _load_pair(A, B, offs, n, EVEN: tl.constexpr):
    # EVEN: the length is a multiple of the block (checked at launch), so no mask: with an unspecialised length a
    # mask would keep the compiler from vectorising (measured on the H200: half the bandwidth).
    if EVEN:
        return tl.load(A + offs).to(tl.float32), tl.load(B + offs).to(tl.float32)
    mask = offs < n
    return (tl.load(A + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(B + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store(PTR, offs, value, n, EVEN: tl.constexpr):
    if EVEN:
        tl.store(PTR + offs, value.to(PTR.dtype.element_ty))
    else:
        tl.store(PTR + offs, value.to(PTR.dtype.element_ty), mask=offs < n)


@triton.jit
def _row_start(pid, col_blocks, in_stride, out_stride, ROWS: tl.constexpr):
    # ROWS: rows of ``width`` elements, gate and up rows ``in_stride`` apart and output rows ``out_stride`` apart
    # (the halves of a concatenated [rows, 2 * width] gate/up tensor), each row ``col_blocks`` programs; else one
    # flat row. The strides stay specialised: known multiples of 16, they keep the loads vectorised.
    if ROWS:
        row = (pid // col_blocks).to(tl.int64)
        in_start, out_start, block = row * in_stride, row * out_stride, pid % col_blocks
    else:
        in_start, out_start, block = 0, 0, pid
    return in_start, out_start, block


@triton.jit(do_not_specialize=["width", "col_blocks"])
def _gated_fwd_kernel(GATE, UP, OUT, width, col_blocks, in_stride, out_stride, GELU: tl.constexpr,
                      BLOCK: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr):
    in_start, out_start, block = _row_start(tl.program_id(0), col_blocks, in_stride, out_stride, ROWS)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a, b = _load_pair(GATE + in_start, UP + in_start, offs, width, EVEN)
    if GELU:
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        act = 0.5 * a * (1.0 + _tanh(inner))
    else:
        act = a * tl.sigmoid(a)
    _store(OUT + out_start, offs, act * b, width, EVEN)


@triton.jit(do_not_specialize=["width", "col_blocks"])
def _gated_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, width, col_blocks, in_stride, out_stride, GELU: tl.constexpr,
                      BLOCK: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr):
    # The forward's layout; the gradients of gate and up are laid out as gate and up themselves.
    in_start, out_start, block = _row_start(tl.program_id(0), col_blocks, in_stride, out_stride, ROWS)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(DOUT + out_start + offs).to(tl.float32)
    else:
        g = tl.load(DOUT + out_start + offs, mask=offs < width, other=0.0).to(tl.float32)
    a, b = _load_pair(GATE + in_start, UP + in_start, offs, width, EVEN)
    if GELU:
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        t = _tanh(inner)
        act = 0.5 * a * (1.0 + t)
        d_act = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * a * a)
    else:
        sig = tl.sigmoid(a)
        act = a * sig
        d_act = sig * (1.0 + a * (1.0 - sig))
    _store(DGATE + in_start, offs, g * b * d_act, width, EVEN)
    _store(DUP + in_start, offs, g * act, width, EVEN)


# 1024 divides every common intermediate size times any token count (3072, 4096, 8192, 11008, 14336, ...).
_GATED_BLOCK = 1024


def _layout(gate: torch.Tensor, up: torch.Tensor) -> tuple[int, int, int]:
    """(rows, width, row stride) of the operands: one flat row when both are contiguous, else the rows of the
    two ``[rows, width]`` halves of a contiguous ``[rows, 2 * width]`` tensor (unit last stride, one row stride)."""
    if gate.is_contiguous() and up.is_contiguous():
        return 1, gate.numel(), 0
    return gate.shape[0], gate.shape[1], gate.stride(0)


def _launch(kernel: object, tensors: tuple[torch.Tensor, ...], rows: int, width: int, in_stride: int,
            gelu: bool) -> None:
    # Rows take the largest block (up to 1024) dividing their width, so whole rows need no mask (768: 256).
    block = _GATED_BLOCK
    while rows > 1 and width % block and block > 128:
        block //= 2
    col_blocks = cdiv(width, block)
    kernel[(rows * col_blocks,)](*tensors, width, col_blocks, in_stride, 0 if rows == 1 else width, gelu, block,
                                 width % block == 0, rows > 1, num_warps=max(1, block // 256))


def gated_forward(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` into a new contiguous tensor, for same-shape, same-dtype operands that are either both
    contiguous or the two halves of a contiguous ``[rows, 2 * width]`` tensor."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, width, in_stride = _layout(gate, up)
    _launch(_gated_fwd_kernel, (gate, up, out), rows, width, in_stride, gelu)
    return out


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gate_up.view(-1, gate_up.shape[-1]).chunk(2, dim=-1)


def _operands(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # ``up`` None: ``gate`` is the concatenated [..., 2 * width] gate/up tensor.
    return (gate, up) if up is not None else _halves(gate)


def _forward(gate: torch.Tensor, up: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    # gated_forward over either operand form, the output shaped as the operands ([..., width] for a projection).
    out = gated_forward(*_operands(gate, up), gelu)
    return out if up is not None else out.view(*gate.shape[:-1], gate.shape[-1] // 2)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gelu):
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        inputs = tuple(t for t in (gate, up) if t is not None)
        # Only intermediate results of the graph (not a caller's leaf tensors, not views into other tensors) may
        # have their storage reused for the gradients in backward.
        ctx.reuse = all(t.grad_fn is not None and t._base is None for t in inputs)
        return _forward(gate, up, gelu)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        # The gradients overwrite the saved gate and up (each element is read before it is written), as Liger
        # does: two fewer [tokens, intermediate] tensors while the backward of the MLP runs. Bumping their version
        # makes any other autograd node that saved the same tensors raise instead of reading gradients.
        grads = (gate, up) if ctx.reuse else tuple(None if t is None else torch.empty_like(t) for t in (gate, up))
        gated_backward(dout, *_operands(gate, up), ctx.gelu, into=_operands(*grads))
        if ctx.reuse:
            torch.autograd.graph.increment_version(tuple(t for t in (gate, up) if t is not None))
        return grads[0], grads[1], None


def gated_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool, *,
                   into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of gate and up (laid out as :func:`gated_forward` takes them), written into ``into`` if given
    (laid out as gate and up; gate and up themselves overwrite the inputs), else into new tensors."""
    dout = dout.contiguous()
    dgate, dup = into if into is not None else (torch.empty_like(gate), torch.empty_like(up))
    rows, width, in_stride = _layout(gate, up)
    _launch(_gated_bwd_kernel, (dout, gate, up, dgate, dup), rows, width, in_stride, gelu)
    return dgate, dup


def gated_activation(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for contiguous same-shape, same-dtype tensors; saves only gate and up for backward."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _Gated.apply(gate, up, gelu)
    return gated_forward(gate, up, gelu)


def gate_up_activation(gate_up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for a contiguous ``[..., 2 * width]`` tensor holding ``[gate | up]`` (the MoE experts'
    concatenated projection), output ``[..., width]``; saves only ``gate_up`` for backward, whose gradient is
    written in one piece (no concatenation of the halves' gradients)."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _Gated.apply(gate_up, None, gelu)
    return _forward(gate_up, None, gelu)


# -------------------------------------------------------------------------------------------------- custom ops


@custom_op("gated", fake=lambda gate, *_: dense_like(gate))
def _gated_op(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    return gated_forward(gate.contiguous(), up.contiguous(), gelu)


@custom_op("gated_backward", fake=lambda dout, gate, up, _: (dense_like(gate), dense_like(up)))
def _gated_backward_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_backward(dout, gate.contiguous(), up.contiguous(), gelu)


register_backward(_gated_op, save=lambda inputs, output: (inputs[:2], inputs[2:]),  # gate, up; gelu
                  grad=lambda saved, dout: (*_gated_backward_op(dout, *saved), None))


def gated_op(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """:func:`gated_activation` through the custom op (same result), for graphs Dynamo traces."""
    return _gated_op(gate, up, gelu)


# ----------------------------------------------------------------------------------------------------- adapters


def _gated_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # Mixed dtypes promote in eager; the flat kernel needs dense, same-shape operands (the fused layout's
    # chunk() halves are strided views: native math there).
    return (
        gate.is_cuda
        and gate.dtype == up.dtype
        and gate.dtype in FLOATS
        and gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
    )


def _gated(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    if not _gated_ok(gate, up) or inference_trace(gate, up):
        return _native.gelu_tanh_mul(gate, up) if gelu else _native.silu_mul(gate, up)
    with on_device_of(gate):
        return (gated_op if tracing() else gated_activation)(gate, up, gelu=gelu)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one Triton launch; only gate and up are saved for backward.

    Example:
        >>> silu_mul(torch.zeros(2, 4), torch.ones(2, 4)).sum().item()   # CPU: native path
        0.0
    """
    return _gated(gate, up, gelu=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` in one Triton launch; only gate and up are saved for backward.

    Example:
        >>> gelu_tanh_mul(torch.zeros(2, 4), torch.ones(2, 4)).sum().item()   # CPU: native path
        0.0
    """
    return _gated(gate, up, gelu=True)


def _liger_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # Mixed dtypes promote in eager; Liger would compute in the gate's dtype.
    return gate.is_cuda and gate.dtype == up.dtype and gate.shape == up.shape and not tracing()


def liger_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``LigerSiLUMulFunction``: one kernel, and only ``gate``/``up`` saved for backward.

    Example:
        >>> liger_silu_mul(torch.zeros(2, 4), torch.ones(2, 4)).shape   # CPU: native path
        torch.Size([2, 4])
    """
    if not _liger_ok(gate, up):
        return _native.silu_mul(gate, up)
    from liger_kernel.ops import LigerSiLUMulFunction

    with on_device_of(gate):
        return LigerSiLUMulFunction.apply(gate, up)


def liger_gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` with ``LigerGELUMulFunction``.

    Example:
        >>> liger_gelu_tanh_mul(torch.zeros(2, 4), torch.ones(2, 4)).shape   # CPU: native path
        torch.Size([2, 4])
    """
    if not _liger_ok(gate, up):
        return _native.gelu_tanh_mul(gate, up)
    from liger_kernel.ops import LigerGELUMulFunction

    with on_device_of(gate):
        return LigerGELUMulFunction.apply(gate, up)
