"""kernels-rocm: a kernels-core plugin for AMD GPUs (ROCm builds of torch).

It declares the Liger-Kernel adapters shared with kernels-cuda (from kernels-triton) with per-architecture
constraints, plus PyTorch-native kernels. Use it through kernels-core, which discovers it by its entry point:

Example:
    >>> from kernels_rocm import rocm_kernel_specs
    >>> "rocm.causal_lm_loss.liger" in {spec.id for spec in rocm_kernel_specs()}
    True
"""

from ._declarations import rocm_kernel_specs
from ._detect import detect_rocm
from ._detect import gfx_arch


__all__ = ["detect_rocm", "gfx_arch", "rocm_kernel_specs"]
