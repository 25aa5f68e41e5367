"""The ``kernels_core.plugins`` entry point of kernels-cuda.

Importing this module imports neither torch, Triton nor Liger: detection imports torch only when called, and
kernel declarations reference their implementations lazily.
"""

from __future__ import annotations

from collections.abc import Iterable

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import hookimpl

from ._declarations import cuda_kernel_specs
from ._detect import detect_cuda


__all__ = ["KERNELS_CORE_PLUGIN_API", "kernels_core_detect_devices", "kernels_core_kernels"]

# The kernels-core plugin API this plugin is written for (kernels_core.plugin.PLUGIN_API_VERSION).
KERNELS_CORE_PLUGIN_API = "1.0"


@hookimpl
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    """The CUDA backend and its devices (none on CPU-only or ROCm builds of torch)."""
    return detect_cuda()


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    """Liger, tuned and PyTorch-native kernels for the ``cuda`` backend."""
    return cuda_kernel_specs()
