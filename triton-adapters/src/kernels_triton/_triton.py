"""Adapters over this package's own Triton kernels (:mod:`kernels_triton._triton_kernels`).

Importing this module imports Triton, so a host without it fails at kernel load time and kernelize falls back
to the next kernel (the report says why), instead of failing at the first call. Each adapter checks that the
kernel reproduces the eager module for the inputs at hand and otherwise takes the native math: CPU tensors,
dtype promotion the kernel does not reproduce, layouts it does not take. Eagerly the kernels run through
``autograd.Function`` s (the cheapest call); while Dynamo traces (``torch.compile``) the same kernels are called
through their ``torch.library`` custom ops (:mod:`kernels_triton._triton_ops`), which Dynamo records as opaque
graph nodes, in training; traced for inference (no autograd graph) they hand Inductor the native math to fuse.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import _cpp_extension
from . import _native
from . import _triton_kernels
from ._compile import inference_trace
from ._compile import tracing
from ._device import eager_device_context
from ._device import on_device_of


__all__ = ["eager_residual_rms_norm", "eager_rms_norm", "gelu_tanh_mul", "residual_rms_norm",
           "residual_rms_norm_supported", "rms_norm", "rms_norm_supported", "rotary_embedding", "silu_mul"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _kernels() -> ModuleType:
    """The eager entry points, or (while Dynamo traces) the same kernels as custom ops; same signatures."""
    if tracing():
        from . import _triton_ops

        return _triton_ops
    return _triton_kernels


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
        and hidden_states.dtype in _FLOATS
        and weight.dtype in _FLOATS
        and weight.is_contiguous()
        and 0 < hidden_states.shape[-1] <= _triton_kernels.MAX_RMS_NORM_COLS
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
        return _kernels().rms_norm(hidden_states, weight, eps=eps, offset=offset, gemma=casting == "gemma")
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
        normed = _eager_autograd_norm(hidden_states, None, weight, eps, offset, casting)
        if normed is not None:
            return normed
    if not rms_norm_supported(hidden_states, weight, casting=casting):
        return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    with eager_device_context(hidden_states):
        return _triton_kernels.rms_norm(hidden_states, weight, eps=eps, offset=offset, gemma=casting == "gemma")


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
        return _kernels().residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset,
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
        outputs = _eager_autograd_norm(hidden_states, residual, weight, eps, offset, casting)
        if outputs is not None:
            return outputs
    if not residual_rms_norm_supported(hidden_states, residual, weight, casting=casting):
        return _native.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
    with eager_device_context(hidden_states):
        return _triton_kernels.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset,
                                                 gemma=casting == "gemma")


# Per input signature of an eager norm call with autograd: the C++ extension's entry
# (:func:`kernels_triton._triton_kernels.cpp_norm_entry`), or False where the Triton kernel does not reproduce the
# module or the extension cannot take the call. Bounded: row counts vary with batch and sequence length.
_EAGER_NORMS: dict[tuple, tuple | bool] = {}
_EAGER_NORMS_MAX = 4096


def _eager_autograd_norm(hidden_states: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, offset: float,
                         casting: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The norm (with ``residual``: the residual add and norm) through kernels-triton's C++ autograd extension, or
    None: the caller then takes the general path.

    This runs once per norm layer per training step, and a mid-size layer's GPU time is shorter than the host
    time of the general path's checks: everything that depends only on the input signature (the support checks,
    the compiled kernels, the launch shapes) is looked up in one dictionary; per call only
    :func:`kernels_triton._triton_kernels.cpp_path_usable` runs in Python, and the extension checks the tensors
    themselves (contiguity, alignment), declining what its kernels do not take.
    """
    key = (hidden_states.shape, hidden_states.dtype, weight.dtype, hidden_states.get_device(), casting, offset != 0.0)
    if residual is not None:
        key += (residual.shape, residual.dtype, residual.get_device())
    entry = _EAGER_NORMS.get(key)
    if entry is None:
        if residual is None:
            supported = rms_norm_supported(hidden_states, weight, casting=casting)
        else:
            supported = residual_rms_norm_supported(hidden_states, residual, weight, casting=casting)
        entry = supported and _triton_kernels.cpp_norm_entry(
            residual is not None, hidden_states.shape, hidden_states.dtype, weight.dtype, casting == "gemma",
            offset != 0.0, hidden_states.get_device())
        if entry is None and _cpp_extension.status() == "building":
            return None  # ask again next call
        if len(_EAGER_NORMS) >= _EAGER_NORMS_MAX:
            _EAGER_NORMS.clear()
        _EAGER_NORMS[key] = entry = entry or False
    if entry is False or not _triton_kernels.cpp_path_usable():
        return None
    return _triton_kernels.run_cpp_norm(entry, hidden_states, residual, weight, eps, offset)


def _gated_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # Mixed dtypes promote in eager; the flat kernel needs dense, same-shape operands (the fused layout's
    # chunk() halves are strided views: native math there).
    return (
        gate.is_cuda
        and gate.dtype == up.dtype
        and gate.dtype in _FLOATS
        and gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
    )


def _gated(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    if not _gated_ok(gate, up) or inference_trace(gate, up):
        return _native.gelu_tanh_mul(gate, up) if gelu else _native.silu_mul(gate, up)
    with on_device_of(gate):
        return _kernels().gated_activation(gate, up, gelu=gelu)


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


def _rotary_ok(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    if not (q.is_cuda and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and unsqueeze_dim in (1, 2)):
        return False
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    rotary_dim = cos.shape[-1]
    return (
        q.dtype == k.dtype == cos.dtype == sin.dtype  # another cos/sin dtype promotes the output in eager
        and q.dtype in _FLOATS
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
    with on_device_of(q):
        if unsqueeze_dim == 2:
            q_out, k_out = _kernels().rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return _kernels().rotary(q, k, cos, sin)
