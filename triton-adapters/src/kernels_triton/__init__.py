"""kernels-triton: the Triton kernels and Liger-Kernel adapters shared by the kernels-cuda and kernels-rocm plugins.

A library, not a plugin: it registers no entry point. The adapter functions live in private modules and are
referenced lazily from kernel declarations (``"kernels_triton._rms_norm:rms_norm"``); importing this package
imports neither torch, Triton nor Liger. One module per op (``_rms_norm``, ``_residual_rms_norm``, ``_rotary``,
``_gated``, ``_loss``, ``_layer_norm``, ``_experts``/``_moe``) holds its own Triton kernels where it has them, their
autograd and custom ops, and its adapters over them and over Liger; ``_native`` the PyTorch-native alternatives.

Example:
    >>> from kernels_triton import liger_kernel_specs
    >>> sorted({spec.kind for spec in liger_kernel_specs("cuda")})[:3]
    ['causal_lm_loss', 'gelu_gated_mlp', 'layer_norm']
"""

from ._specs import LIGER_ADAPTERS
from ._specs import LIGER_REQUIREMENT
from ._specs import NATIVE_ADAPTERS
from ._specs import TRITON_ADAPTERS
from ._specs import AdapterEntry
from ._specs import adapter_kernel_specs
from ._specs import liger_kernel_specs
from ._specs import native_kernel_specs
from ._specs import triton_kernel_specs


__all__ = [
    "LIGER_ADAPTERS",
    "LIGER_REQUIREMENT",
    "NATIVE_ADAPTERS",
    "TRITON_ADAPTERS",
    "AdapterEntry",
    "adapter_kernel_specs",
    "liger_kernel_specs",
    "native_kernel_specs",
    "triton_kernel_specs",
]
