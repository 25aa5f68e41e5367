"""kernels-triton's public operations: the adapters kernel declarations name, and the kernel-level entry points and
C++ autograd controls that benchmarks and tuning use.

Everything another package uses from kernels-triton is here or at the package's top level (the declaration
builders); the ``_``-prefixed modules behind these names are private and may change in any release. The names
below keep their meaning within a minor release: kernels-cuda and kernels-rocm depend on
``kernels-triton>=0.2,<0.3`` (0.2 is the first release with this module).

**Adapters**, following ``core/docs/kernel-conventions.md`` for their layer kind. Kernel declarations reference them
as ``"kernels_triton.ops:<name>"`` (see :func:`kernels_triton.adapter_kernel_specs`); unprefixed names are this
package's own Triton kernels, ``liger_`` ones Liger-Kernel's, ``native_`` ones PyTorch's:

- RMSNorm: :func:`rms_norm` (and :func:`eager_rms_norm` for callers that know they are not traced),
  :func:`liger_rms_norm`, :func:`native_rms_norm`;
- residual add + RMSNorm: :func:`residual_rms_norm` (:func:`eager_residual_rms_norm`),
  :func:`native_residual_rms_norm`;
- gated MLP activations: :func:`silu_mul`, :func:`gelu_tanh_mul`, :func:`liger_silu_mul`,
  :func:`liger_gelu_tanh_mul`, :func:`native_silu_mul`, :func:`native_gelu_tanh_mul`;
- RoPE: :func:`rotary_embedding`, :func:`liger_rotary_embedding`, :func:`native_rotary_embedding`;
- LayerNorm: :func:`liger_layer_norm`, :func:`native_layer_norm`;
- MoE experts: :func:`moe_experts_silu`, :func:`moe_experts_gelu_tanh` (two grouped products),
  :func:`liger_moe_experts_silu`;
- causal-LM loss: :func:`liger_fused_linear_cross_entropy`;
- packed rows' attention per document: :func:`native_varlen_attention` (FlashAttention's varlen kernel as ATen
  ships it).

**The RMSNorm kernels' own entry points**, for benchmarks and tuning sweeps: :func:`apply_rms_norm` (the Python
autograd path), :func:`rms_norm_forward`, :func:`rms_norm_backward`, :func:`add_rms_norm_backward`,
:func:`sum_partial_rows`, their launch shapes :func:`norm_tiling` and :func:`norm_backward_tiling`, and
``rms_norm_forward_kernel``, the Triton kernel :func:`rms_norm_forward` launches (``kernel[grid](x, weight, y,
rstd_or_y, n_rows, eps, offset, n_cols, gemma, has_offset, store_rstd, BLOCK_M, BLOCK_N, num_warps=...)``, with
:func:`norm_tiling`'s shape), to time Triton's own launch.

**The norms' C++ autograd nodes**: :func:`cpp_autograd_extension` (starts the background build, or waits for it),
:func:`cpp_autograd_status`, :func:`cpp_autograd_failure`, :func:`cpp_autograd_norm_call` (a node's entry, to time it
alone) and :func:`python_autograd_norms` (a context that takes the Python autograd path instead).

Each name is loaded on first use: importing this module imports neither torch, Triton nor Liger, and a native
adapter loads no Triton. Resolving an unprefixed or ``liger_`` adapter other than :func:`liger_layer_norm` (what
kernelize does when it binds one) also starts Triton's one-off runtime set-up on a background thread
(:mod:`kernels_triton._warmup`; only where there is a GPU, off with ``KERNELS_TRITON_WARMUP=0``); importing a module
of this package never does.

Example:
    >>> import torch
    >>> from kernels_triton import ops
    >>> x, weight = torch.randn(4, 64), torch.ones(64)
    >>> ops.rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama").shape   # CPU tensors: the native path
    torch.Size([4, 64])
    >>> torch.equal(ops.native_silu_mul(x, x), torch.nn.functional.silu(x) * x)
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from typing import Any

from . import _warmup


if TYPE_CHECKING:  # the names as static analysis sees them; at run time __getattr__ loads each on first use
    from ._cpp_extension import extension as cpp_autograd_extension
    from ._cpp_extension import failure as cpp_autograd_failure
    from ._cpp_extension import norm_call as cpp_autograd_norm_call
    from ._cpp_extension import python_autograd as python_autograd_norms
    from ._cpp_extension import status as cpp_autograd_status
    from ._experts import moe_experts_gelu_tanh
    from ._experts import moe_experts_silu
    from ._gated import gelu_tanh_mul
    from ._gated import liger_gelu_tanh_mul
    from ._gated import liger_silu_mul
    from ._gated import silu_mul
    from ._layer_norm import layer_norm as liger_layer_norm
    from ._loss import fused_linear_cross_entropy as liger_fused_linear_cross_entropy
    from ._moe import moe_experts_silu as liger_moe_experts_silu
    from ._native import gelu_tanh_mul as native_gelu_tanh_mul
    from ._native import layer_norm as native_layer_norm
    from ._native import residual_rms_norm as native_residual_rms_norm
    from ._native import rms_norm as native_rms_norm
    from ._native import rotary_embedding as native_rotary_embedding
    from ._native import silu_mul as native_silu_mul
    from ._norm_kernels import _rms_norm_fwd_kernel as rms_norm_forward_kernel
    from ._norm_kernels import add_rms_norm_backward
    from ._norm_kernels import norm_backward_tiling
    from ._norm_kernels import norm_tiling
    from ._norm_kernels import rms_norm_backward
    from ._norm_kernels import rms_norm_forward
    from ._norm_kernels import sum_partial_rows
    from ._residual_rms_norm import eager_residual_rms_norm
    from ._residual_rms_norm import residual_rms_norm
    from ._rms_norm import apply_rms_norm
    from ._rms_norm import eager_rms_norm
    from ._rms_norm import liger_rms_norm
    from ._rms_norm import rms_norm
    from ._rotary import liger_rotary_embedding
    from ._rotary import rotary_embedding
    from ._varlen import varlen_attention as native_varlen_attention


# Public name -> (private module, attribute).
_SOURCES: dict[str, tuple[str, str]] = {
    # This package's own Triton kernels.
    "rms_norm": ("_rms_norm", "rms_norm"),
    "eager_rms_norm": ("_rms_norm", "eager_rms_norm"),
    "residual_rms_norm": ("_residual_rms_norm", "residual_rms_norm"),
    "eager_residual_rms_norm": ("_residual_rms_norm", "eager_residual_rms_norm"),
    "silu_mul": ("_gated", "silu_mul"),
    "gelu_tanh_mul": ("_gated", "gelu_tanh_mul"),
    "rotary_embedding": ("_rotary", "rotary_embedding"),
    "moe_experts_silu": ("_experts", "moe_experts_silu"),
    "moe_experts_gelu_tanh": ("_experts", "moe_experts_gelu_tanh"),
    # Liger-Kernel's.
    "liger_rms_norm": ("_rms_norm", "liger_rms_norm"),
    "liger_silu_mul": ("_gated", "liger_silu_mul"),
    "liger_gelu_tanh_mul": ("_gated", "liger_gelu_tanh_mul"),
    "liger_rotary_embedding": ("_rotary", "liger_rotary_embedding"),
    "liger_layer_norm": ("_layer_norm", "layer_norm"),
    "liger_moe_experts_silu": ("_moe", "moe_experts_silu"),
    "liger_fused_linear_cross_entropy": ("_loss", "fused_linear_cross_entropy"),
    # PyTorch-native.
    "native_rms_norm": ("_native", "rms_norm"),
    "native_residual_rms_norm": ("_native", "residual_rms_norm"),
    "native_silu_mul": ("_native", "silu_mul"),
    "native_gelu_tanh_mul": ("_native", "gelu_tanh_mul"),
    "native_rotary_embedding": ("_native", "rotary_embedding"),
    "native_layer_norm": ("_native", "layer_norm"),
    "native_varlen_attention": ("_varlen", "varlen_attention"),
    # The RMSNorm kernels' own entry points.
    "apply_rms_norm": ("_rms_norm", "apply_rms_norm"),
    "rms_norm_forward": ("_norm_kernels", "rms_norm_forward"),
    "rms_norm_backward": ("_norm_kernels", "rms_norm_backward"),
    "add_rms_norm_backward": ("_norm_kernels", "add_rms_norm_backward"),
    "sum_partial_rows": ("_norm_kernels", "sum_partial_rows"),
    "norm_tiling": ("_norm_kernels", "norm_tiling"),
    "norm_backward_tiling": ("_norm_kernels", "norm_backward_tiling"),
    "rms_norm_forward_kernel": ("_norm_kernels", "_rms_norm_fwd_kernel"),
    # The norms' C++ autograd nodes.
    "cpp_autograd_extension": ("_cpp_extension", "extension"),
    "cpp_autograd_status": ("_cpp_extension", "status"),
    "cpp_autograd_failure": ("_cpp_extension", "failure"),
    "cpp_autograd_norm_call": ("_cpp_extension", "norm_call"),
    "python_autograd_norms": ("_cpp_extension", "python_autograd"),
}

# The modules whose adapters start the warm-up when resolved, and what the thread imports besides Triton's runtime
# set-up: the kernel modules the experts' first GPU call would import (and Triton with them), and Liger's operators
# for the loss (0.6 s to import on an H100 host), instead of in the first step. The native adapters and Liger's
# LayerNorm start nothing, as before.
_WARM_UP: dict[str, tuple[str, ...]] = {
    "_rms_norm": (),
    "_residual_rms_norm": (),
    "_gated": (),
    "_rotary": (),
    "_experts": ("kernels_triton._gated", "kernels_triton._combine"),
    "_moe": ("kernels_triton._gated", "kernels_triton._combine"),
    "_loss": ("liger_kernel.ops.fused_linear_cross_entropy",),
}

__all__ = ["add_rms_norm_backward", "apply_rms_norm", "cpp_autograd_extension", "cpp_autograd_failure",
           "cpp_autograd_norm_call", "cpp_autograd_status", "eager_residual_rms_norm", "eager_rms_norm",
           "gelu_tanh_mul", "liger_fused_linear_cross_entropy", "liger_gelu_tanh_mul", "liger_layer_norm",
           "liger_moe_experts_silu", "liger_rms_norm", "liger_rotary_embedding", "liger_silu_mul",
           "moe_experts_gelu_tanh", "moe_experts_silu", "native_gelu_tanh_mul", "native_layer_norm",
           "native_residual_rms_norm", "native_rms_norm", "native_rotary_embedding", "native_silu_mul",
           "native_varlen_attention",
           "norm_backward_tiling", "norm_tiling", "python_autograd_norms", "residual_rms_norm", "rms_norm",
           "rms_norm_backward", "rms_norm_forward", "rms_norm_forward_kernel", "rotary_embedding", "silu_mul",
           "sum_partial_rows"]


def __getattr__(name: str) -> Any:
    # Called only for names not loaded yet: the value is kept in this module's namespace, so every later lookup
    # (kernelize caches the reference too) is a plain attribute read.
    try:
        module_name, attribute = _SOURCES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__package__}.{module_name}"), attribute)
    globals()[name] = value
    warm = _WARM_UP.get(module_name)
    if warm is not None:
        _warmup.start(*warm)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
