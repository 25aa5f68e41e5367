"""The residual add and the RMSNorm after it (a decoder layer's ``residual + attn_out`` and post-attention norm):
the autograd of this package's Triton kernel, one launch per direction (a Python ``autograd.Function``, or the C++
node of :mod:`kernels_triton._cpp_extension` once built), its ``torch.library`` custom ops and the adapter.

The forward (:func:`kernels_triton._norm_kernels.add_rms_norm_forward`) writes the normalised sum and the sum (the
next residual, which the layer keeps anyway); the backward is
:func:`kernels_triton._norm_kernels.add_rms_norm_backward` over the saved sum, adding the gradient that reaches the
sum directly, so the attention output and the residual get their gradient from one kernel. Liger has no such
kernel.
"""

# autograd.Function's forward and backward take a context and tensors, typed by torch itself.
# ruff: noqa: ANN001

from __future__ import annotations

import torch

from . import _cpp_extension
from . import _native
from ._compile import inference_trace
from ._compile import tracing
from ._custom_op import custom_op
from ._custom_op import dense_like
from ._custom_op import register_backward
from ._device import eager_device_context
from ._norm_kernels import add_rms_norm_backward
from ._norm_kernels import add_rms_norm_forward
from ._rms_norm import rms_norm_supported


__all__ = ["apply_residual_rms_norm", "eager_residual_rms_norm", "residual_rms_norm", "residual_rms_norm_op",
           "residual_rms_norm_supported"]


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, weight, eps, offset, gemma):
        y, s, _ = add_rms_norm_forward(x, r, weight, eps, offset, gemma, store_rstd=False)
        # The sum is an output the caller keeps anyway (it is the next residual): saving it costs no memory. The
        # backward recomputes the rows' rstd from it.
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        if dy is None:  # the normalised output was not used: only the sum's gradient flows, unchanged
            return ds if need_x else None, ds if need_r else None, None, None, None, None
        dx, dw = add_rms_norm_backward(dy, ds, s, weight, None, ctx.offset, ctx.gemma, want_dw=need_w, eps=ctx.eps)
        return dx if need_x else None, dx if need_r else None, dw, None, None, None


def apply_residual_rms_norm(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                            eps: float, offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + hidden_states), residual + hidden_states)`` in one launch per direction, through the
    Python autograd path.

    Same-shape, same-dtype inputs; outputs in that dtype. Callers check the supported cases. Saves the sum (which
    the caller keeps as the next residual anyway); under ``no_grad`` nothing.
    """
    x, r = hidden_states.contiguous(), residual.contiguous()
    if torch.is_grad_enabled() and (hidden_states.requires_grad or residual.requires_grad or weight.requires_grad):
        return _AddRMSNorm.apply(x, r, weight, float(eps), float(offset), gemma)
    y, s, _ = add_rms_norm_forward(x, r, weight, float(eps), float(offset), gemma, store_rstd=False)
    return y, s


# --------------------------------------------------------------------------------------------------- custom ops


# Like the RMSNorm op, the forward always writes rstd; the sum is an output the caller keeps as the next residual.
@custom_op("add_rms_norm", fake=lambda x2, *_: (dense_like(x2), dense_like(x2),
                                                x2.new_empty((x2.shape[0],), dtype=torch.float32)))
def _add_rms_norm_op(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                     gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x2.contiguous(), r2.contiguous(), weight, eps, offset, gemma, store_rstd=True)


@custom_op("add_rms_norm_backward", fake=lambda dy, ds, s2, weight, *_: (dense_like(s2), torch.empty_like(weight)))
def _add_rms_norm_backward_op(dy: torch.Tensor, ds: torch.Tensor | None, s2: torch.Tensor, weight: torch.Tensor,
                              rstd: torch.Tensor, offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_backward(dy, ds, s2.contiguous(), weight, rstd, offset, gemma, want_dw=True)


def _add_rms_norm_grad(saved: tuple, dy: torch.Tensor | None, ds: torch.Tensor | None, _: torch.Tensor) -> tuple:
    s = saved[0]
    # Autograd may pass None for an unused normalised output; the sum's gradient is that of both of its inputs.
    dx, dw = _add_rms_norm_backward_op(torch.zeros_like(s) if dy is None else dy, ds, *saved)
    return dx, dx, dw, None, None, None


register_backward(_add_rms_norm_op, save=lambda inputs, output: ((output[1], inputs[2], output[2]), inputs[4:]),
                  grad=_add_rms_norm_grad, non_differentiable=(2,))  # saves the sum, the weight and rstd


def residual_rms_norm_op(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                         offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_residual_rms_norm` through the custom op (same arguments, same result), for traced graphs."""
    n_cols = hidden_states.shape[-1]
    y, s, _ = _add_rms_norm_op(hidden_states.reshape(-1, n_cols), residual.reshape(-1, n_cols), weight, float(eps),
                               float(offset), gemma)
    return y.view(hidden_states.shape), s.view(hidden_states.shape)


# ----------------------------------------------------------------------------------------------------- adapters


def residual_rms_norm_supported(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                                casting: str) -> bool:
    """Whether the fused Triton kernel reproduces the eager residual add and norm for these inputs.

    As :func:`rms_norm_supported`, and the residual has the attention output's shape, dtype and device (another
    dtype would promote the sum in eager).

    Example:
        >>> x = torch.zeros(2, 8)
        >>> residual_rms_norm_supported(x, x, torch.zeros(8), casting="llama")   # CPU tensors: native path
        False
    """
    return (
        residual.dtype == hidden_states.dtype
        and residual.shape == hidden_states.shape
        and residual.device == hidden_states.device
        and rms_norm_supported(hidden_states, weight, casting=casting)
    )


def residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the RMSNorm after it, one Triton launch per direction.

    Returns ``(rms_norm(residual + hidden_states), residual + hidden_states)``. Saves the sum (the next residual,
    kept by the layer anyway) and nothing else; the backward adds the gradient reaching the sum
    directly, so the attention output and the residual get their gradient from one kernel.

    Example:
        >>> x, residual, w = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64)   # CPU: native path
        >>> normed, new_residual = residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
        >>> torch.equal(new_residual, residual + x)
        True
    """
    if tracing():
        if (not residual_rms_norm_supported(hidden_states, residual, weight, casting=casting)
                or inference_trace(hidden_states, residual, weight)):
            return _native.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset,
                                             casting=casting)
        return residual_rms_norm_op(hidden_states, residual, weight, eps=eps, offset=offset,
                                    gemma=casting == "gemma")
    return eager_residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)


def eager_residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`residual_rms_norm` for callers that already know they run eagerly (not under Dynamo).

    Example:
        >>> x, residual, w = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64)   # CPU: native path
        >>> normed, new_residual = eager_residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
        >>> torch.equal(new_residual, residual + x)
        True
    """
    if torch.is_grad_enabled() and (hidden_states.requires_grad or residual.requires_grad or weight.requires_grad):
        outputs = _cpp_extension.eager_norm(hidden_states, residual, weight, eps, offset, casting,
                                            supported=residual_rms_norm_supported)
        if outputs is not None:
            return outputs
    if not residual_rms_norm_supported(hidden_states, residual, weight, casting=casting):
        return _native.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
    with eager_device_context(hidden_states):
        return apply_residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset,
                                       gemma=casting == "gemma")
