"""This package's Triton kernels as ``torch.library`` custom ops, for graphs traced by ``torch.compile``.

Eagerly the kernels run through plain ``autograd.Function`` s (:mod:`kernels_triton._triton_kernels`): a custom
op's dispatch costs several microseconds per call, as much as a small kernel. Dynamo cannot trace into those
functions' launches, so under ``torch.compile`` the adapters call the same kernels through the ops below: each
has a fake implementation (shapes, dtypes and strides without running anything) and an autograd formula, so a
compiled graph holds one opaque node per kernel and direction, without graph breaks, and saves for backward
exactly what the eager kernels save. Inductor never autotunes or rewrites the Triton code inside.

Outputs never alias inputs (custom ops may not return views of their arguments), so the gated backward writes
new tensors instead of reusing the saved gate and up as it does eagerly; Inductor's buffer reuse frees them.

Example:
    >>> import torch
    >>> from kernels_triton import _triton_ops   # doctest: +SKIP
    >>> x, w = torch.randn(8, 64, device="cuda"), torch.ones(64, device="cuda")   # doctest: +SKIP
    >>> torch.compile(lambda x: _triton_ops.rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False),
    ...               fullgraph=True)(x).shape   # doctest: +SKIP
    torch.Size([8, 64])
"""

from __future__ import annotations

import torch

from . import _triton_kernels
from ._device import on_device_of


__all__ = ["gated_activation", "residual_rms_norm", "rms_norm", "rotary"]


# ------------------------------------------------------------------------------------------------------ RMSNorm


# The forward always writes rstd (4 bytes per row, against 2 x row width bytes moved per row): a no-grad variant
# would be a second op whose output a later backward could be wired to by mistake.
@torch.library.custom_op("kernels_triton::rms_norm", mutates_args=())
def _rms_norm_op(
    x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    with on_device_of(x2):
        return _triton_kernels.rms_norm_forward(x2.contiguous(), weight, eps, offset, gemma, store_rstd=True)


@_rms_norm_op.register_fake
def _(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
      gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x2, memory_format=torch.contiguous_format),
            x2.new_empty((x2.shape[0],), dtype=torch.float32))


@torch.library.custom_op("kernels_triton::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    with on_device_of(x2):
        dx, dw = _triton_kernels.rms_norm_backward(dy, x2.contiguous(), weight, rstd, offset, gemma, want_dw=True)
    return dx, dw


@_rms_norm_backward_op.register_fake
def _(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
      gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_norm_setup(ctx: object, inputs: tuple, output: tuple) -> None:
    x2, weight, _, offset, gemma = inputs
    _, rstd = output
    ctx.save_for_backward(x2, weight, rstd)  # type: ignore[attr-defined]
    ctx.offset, ctx.gemma = offset, gemma  # type: ignore[attr-defined]
    ctx.mark_non_differentiable(rstd)  # type: ignore[attr-defined]


def _rms_norm_grad(ctx: object, dy: torch.Tensor, _: torch.Tensor) -> tuple:
    x2, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
    dx, dw = _rms_norm_backward_op(dy, x2, weight, rstd, ctx.offset, ctx.gemma)  # type: ignore[attr-defined]
    return dx, dw, None, None, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
             gemma: bool) -> torch.Tensor:
    """:func:`kernels_triton._triton_kernels.rms_norm` through the custom op (same arguments, same result)."""
    n_cols = hidden_states.shape[-1]
    x2 = hidden_states.reshape(-1, n_cols)
    y, _ = _rms_norm_op(x2, weight, float(eps), float(offset), gemma)
    return y.view(hidden_states.shape)


# ---------------------------------------------------------------------------------------- residual add + RMSNorm


# Like the RMSNorm op, the forward always writes rstd; the sum is an output the caller keeps as the next residual.
@torch.library.custom_op("kernels_triton::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with on_device_of(x2):
        y, s, rstd = _triton_kernels.add_rms_norm_forward(x2.contiguous(), r2.contiguous(), weight, eps, offset,
                                                          gemma, store_rstd=True)
    return y, s, rstd


@_add_rms_norm_op.register_fake
def _(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
      gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x2, memory_format=torch.contiguous_format),
            torch.empty_like(x2, memory_format=torch.contiguous_format),
            x2.new_empty((x2.shape[0],), dtype=torch.float32))


@torch.library.custom_op("kernels_triton::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(
    dy: torch.Tensor, ds: torch.Tensor | None, s2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    with on_device_of(s2):
        dx, dw = _triton_kernels.add_rms_norm_backward(dy, ds, s2.contiguous(), weight, rstd, offset, gemma,
                                                       want_dw=True)
    return dx, dw


@_add_rms_norm_backward_op.register_fake
def _(dy: torch.Tensor, ds: torch.Tensor | None, s2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
      offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(s2, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _add_rms_norm_setup(ctx: object, inputs: tuple, output: tuple) -> None:
    _, _, weight, _, offset, gemma = inputs
    _, s, rstd = output
    ctx.save_for_backward(s, weight, rstd)  # type: ignore[attr-defined]
    ctx.offset, ctx.gemma = offset, gemma  # type: ignore[attr-defined]
    ctx.mark_non_differentiable(rstd)  # type: ignore[attr-defined]


def _add_rms_norm_grad(ctx: object, dy: torch.Tensor | None, ds: torch.Tensor | None, _: torch.Tensor) -> tuple:
    s, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
    if dy is None:  # the normalised output was not used (autograd may pass None for it)
        dy = torch.zeros_like(s)
    dx, dw = _add_rms_norm_backward_op(dy, ds, s, weight, rstd, ctx.offset, ctx.gemma)  # type: ignore[attr-defined]
    # The sum's gradient is that of both of its inputs.
    return dx, dx, dw, None, None, None


_add_rms_norm_op.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)


def residual_rms_norm(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                      offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels_triton._triton_kernels.residual_rms_norm` through the custom op (same arguments, same result)."""
    n_cols = hidden_states.shape[-1]
    y, s, _ = _add_rms_norm_op(hidden_states.reshape(-1, n_cols), residual.reshape(-1, n_cols), weight, float(eps),
                               float(offset), gemma)
    return y.view(hidden_states.shape), s.view(hidden_states.shape)


# --------------------------------------------------------------------------------------------------------- RoPE


@torch.library.custom_op("kernels_triton::rotary", mutates_args=())
def _rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dense = _triton_kernels.unit_last_stride
    with on_device_of(q):
        return _triton_kernels.rotary_launch(dense(q), dense(k), dense(cos), dense(sin), backward)


@_rotary_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
      backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernel writes outputs with the strides of the q and k it reads (empty_like keeps a dense layout's strides).
    dense = _triton_kernels.unit_last_stride
    return torch.empty_like(dense(q)), torch.empty_like(dense(k))


def _rotary_setup(ctx: object, inputs: tuple, output: tuple) -> None:
    _, _, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)  # type: ignore[attr-defined]


def _rotary_grad(ctx: object, dq: torch.Tensor, dk: torch.Tensor) -> tuple:
    cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
    dq_in, dk_in = _rotary_op(dq, dk, cos, sin, True)
    return dq_in, dk_in, None, None, None


_rotary_op.register_autograd(_rotary_grad, setup_context=_rotary_setup)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """:func:`kernels_triton._triton_kernels.rotary` through the custom op (same arguments, same result)."""
    return _rotary_op(q, k, cos, sin, False)


# -------------------------------------------------------------------------------------------------- gated MLPs


@torch.library.custom_op("kernels_triton::gated", mutates_args=())
def _gated_op(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    with on_device_of(gate):
        return _triton_kernels.gated_forward(gate.contiguous(), up.contiguous(), gelu)


@_gated_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("kernels_triton::gated_backward", mutates_args=())
def _gated_backward_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    with on_device_of(gate):
        return _triton_kernels.gated_backward(dout, gate.contiguous(), up.contiguous(), gelu)


@_gated_backward_op.register_fake
def _(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _gated_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, gelu = inputs
    ctx.save_for_backward(gate, up)  # type: ignore[attr-defined]
    ctx.gelu = gelu  # type: ignore[attr-defined]


def _gated_grad(ctx: object, dout: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors  # type: ignore[attr-defined]
    dgate, dup = _gated_backward_op(dout, gate, up, ctx.gelu)  # type: ignore[attr-defined]
    return dgate, dup, None


_gated_op.register_autograd(_gated_grad, setup_context=_gated_setup)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """:func:`kernels_triton._triton_kernels.gated_activation` through the custom op (same result)."""
    return _gated_op(gate, up, gelu)
