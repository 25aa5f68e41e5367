"""RMSNorm (standard and offset, Llama and Gemma casting): the autograd of this package's Triton kernels (a Python
``autograd.Function``, or the C++ nodes of :mod:`kernels_triton._cpp_extension` once built), their
``torch.library`` custom ops for ``torch.compile``, the adapter over them and the adapter over Liger's kernel. The
kernels themselves and their launches are in :mod:`kernels_triton._norm_kernels`, which the C++ nodes launch too.

Why own kernels beside Liger's: measured on an H200 (the RMSNorm benchmark at commit
082ada2), Liger's RMSNorm spends 60-120 us per forward and ~600 us per backward on the host whatever the size, and
neither it nor ``F.rms_norm`` reaches 85% of copy bandwidth between 16M and 67M elements. These kernels make one
launch per direction (the backward adds a small one summing the weight gradient's per-program rows), compute in
float32 with the eager module's rounding points and save only the input (the backward recomputes each row's
rstd); the custom ops save one float32 rstd per row besides. The backward kernel is shared with the residual add
+ RMSNorm (:mod:`kernels_triton._residual_rms_norm`), whose sum may receive a gradient of its own.

Importing this module imports Triton: a host without it fails at kernel load time and kernelize falls back.
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
from ._device import on_device_of
from ._launch import FLOATS
from ._norm_kernels import rms_norm_backward
from ._norm_kernels import rms_norm_forward


__all__ = ["MAX_RMS_NORM_COLS", "apply_rms_norm", "eager_rms_norm", "liger_rms_norm", "liger_supports", "rms_norm",
           "rms_norm_op", "rms_norm_supported"]

# Rows longer than this do not fit one block's registers; callers take the native path instead.
MAX_RMS_NORM_COLS = 32768


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma):
        # Saves the input only: the backward recomputes the rows' rstd (see _norm_kernels._rms_norm_bwd_kernel).
        y, _ = rms_norm_forward(x, weight, eps, offset, gemma, store_rstd=False)
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, None, ctx.offset, ctx.gemma, want_dw=ctx.needs_input_grad[1],
                                   eps=ctx.eps)
        return dx, dw, None, None, None


def apply_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
                   gemma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension through the Python autograd path; output in the input dtype. Callers check
    the supported cases.

    Without autograd (inference, ``no_grad``) the kernel runs directly. A contiguous input is read in place
    and the output has its shape: no reshapes on the way (each costs host time per call).

    Example (on CPU tensors, in Triton's interpreter):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x = torch.randn(2, 3, 64, device=device, requires_grad=True)
        >>> y = apply_rms_norm(x, torch.ones(64, device=device), eps=1e-6, offset=0.0, gemma=False)
        >>> y.shape, type(y.grad_fn).__name__
        (torch.Size([2, 3, 64]), '_RMSNormBackward')
    """
    x = hidden_states.contiguous()  # the tensor itself when it already is
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, float(eps), float(offset), gemma)
    return rms_norm_forward(x, weight, float(eps), float(offset), gemma, store_rstd=False)[0]


# --------------------------------------------------------------------------------------------------- custom ops


# The forward always writes rstd (4 bytes per row, against 2 x row width bytes moved per row): a no-grad variant
# would be a second op whose output a later backward could be wired to by mistake.
@custom_op("rms_norm", fake=lambda x2, *_: (dense_like(x2), x2.new_empty((x2.shape[0],), dtype=torch.float32)))
def _rms_norm_op(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x2.contiguous(), weight, eps, offset, gemma, store_rstd=True)


@custom_op("rms_norm_backward", fake=lambda dy, x2, weight, *_: (dense_like(x2), torch.empty_like(weight)))
def _rms_norm_backward_op(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, x2.contiguous(), weight, rstd, offset, gemma, want_dw=True)


register_backward(
    _rms_norm_op, save=lambda inputs, output: ((inputs[0], inputs[1], output[1]), inputs[3:]),  # x2, weight, rstd
    grad=lambda saved, dy, _: (*_rms_norm_backward_op(dy, *saved), None, None, None), non_differentiable=(1,))


def rms_norm_op(hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
                gemma: bool) -> torch.Tensor:
    """:func:`apply_rms_norm` through the custom op (same arguments, same result), for graphs Dynamo traces."""
    n_cols = hidden_states.shape[-1]
    x2 = hidden_states.reshape(-1, n_cols)
    y, _ = _rms_norm_op(x2, weight, float(eps), float(offset), gemma)
    return y.view(hidden_states.shape)


# ----------------------------------------------------------------------------------------------------- adapters


def rms_norm_supported(hidden_states: torch.Tensor, weight: torch.Tensor, *, casting: str) -> bool:
    """Whether the Triton RMSNorm reproduces the eager module for these inputs.

    The output is written in the input dtype (see :func:`kernels_triton._native.writes_input_dtype`), and rows
    must fit one block.

    Example:
        >>> rms_norm_supported(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), casting="llama")
        False
    """
    return (
        _native.writes_input_dtype(hidden_states, weight, casting=casting)
        and hidden_states.dtype in FLOATS
        and weight.dtype in FLOATS
        and weight.is_contiguous()
        and 0 < hidden_states.shape[-1] <= MAX_RMS_NORM_COLS
        and hidden_states.numel() > 0
    )


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm (standard and offset, Llama and Gemma casting) with one Triton launch per direction.

    Saves the input for backward (the backward recomputes each row's rstd); under ``no_grad`` it stores nothing.

    Example:
        >>> x, w = torch.randn(4, 64), torch.ones(64)   # CPU tensors take the native path
        >>> rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if tracing():
        if not rms_norm_supported(hidden_states, weight, casting=casting) or inference_trace(hidden_states, weight):
            return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
        return rms_norm_op(hidden_states, weight, eps=eps, offset=offset, gemma=casting == "gemma")
    return eager_rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)


def eager_rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """:func:`rms_norm` for callers that already know they run eagerly (not under Dynamo).

    Example:
        >>> x, w = torch.randn(4, 64), torch.ones(64)   # CPU tensors take the native path
        >>> eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        normed = _cpp_extension.eager_norm(hidden_states, None, weight, eps, offset, casting,
                                           supported=rms_norm_supported)
        if normed is not None:
            return normed
    if not rms_norm_supported(hidden_states, weight, casting=casting):
        return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    with eager_device_context(hidden_states):
        return apply_rms_norm(hidden_states, weight, eps=eps, offset=offset, gemma=casting == "gemma")


# Liger's RMSNorm loads a whole row into one block; beyond 64 KiB per row it raises in backward.
_MAX_ROW_BYTES = 65536


def liger_supports(hidden_states: torch.Tensor, weight: torch.Tensor, *, casting: str) -> bool:
    """Whether Liger's kernel reproduces the eager module for these inputs (and rows fit Liger's 64 KiB block).

    Example:
        >>> liger_supports(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), casting="llama")
        False
    """
    return (_native.writes_input_dtype(hidden_states, weight, casting=casting)
            and hidden_states.shape[-1] * hidden_states.element_size() <= _MAX_ROW_BYTES)


def liger_rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm with ``LigerRMSNormFunction``, launched on the input's device.

    ``in_place=False`` always: with ``in_place=True`` Liger overwrites the incoming gradient ``dY`` with ``dX``,
    and a residual branch that still needs ``dY`` then gets a wrong gradient (Liger #370, Gemma2 failed to
    converge). While Dynamo traces this function it returns the native math, so Inductor fuses it and never
    autotunes Liger's kernel (Liger + ``torch.compile`` crashed with an illegal memory access there).

    Example:
        >>> x, w = torch.randn(4, 64), torch.ones(64)   # CPU tensors take the native path
        >>> liger_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if tracing() or not liger_supports(hidden_states, weight, casting=casting):
        return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    from liger_kernel.ops import LigerRMSNormFunction

    with on_device_of(hidden_states):
        return LigerRMSNormFunction.apply(hidden_states, weight, eps, offset, casting, False)
