"""kernels-cuda: a kernels-core plugin for NVIDIA GPUs.

Use it through kernels-core, which discovers it by its entry point:

Example:
    >>> from kernels_cuda import cuda_kernel_specs
    >>> "cuda.causal_lm_loss.liger" in {spec.id for spec in cuda_kernel_specs()}
    True
"""

from ._declarations import cuda_kernel_specs
from ._detect import detect_cuda


__all__ = ["cuda_kernel_specs", "detect_cuda"]
