"""kernels-triton: the Triton kernels and Liger-Kernel adapters shared by the kernels-cuda and kernels-rocm plugins.

A library, not a plugin: it registers no entry point. Its public API is this package's top level (the declaration
builders below) and :mod:`kernels_triton.ops`, which holds the adapter functions kernel declarations reference
lazily (``"kernels_triton.ops:rms_norm"``) and the kernel-level entry points benchmarks use; importing either
imports neither torch, Triton nor Liger. Behind ``ops``, private modules hold one op each (``_rms_norm``,
``_residual_rms_norm``, ``_rotary``, ``_gated``, ``_loss``, ``_layer_norm``, ``_experts``/``_moe``): its Triton
kernels where it has them (the norms' in ``_norm_kernels``), their autograd and custom ops, and its adapters over
them and over Liger; ``_native`` holds the PyTorch-native alternatives. Other packages import public names only.

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
