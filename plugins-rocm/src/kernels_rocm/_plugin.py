"""The ``kernels_core.plugins`` entry point of kernels-rocm.

Importing this module imports neither torch, Triton nor Liger: detection imports torch only when called, and
kernel declarations reference their implementations lazily (the shared adapters in kernels-triton).
"""

from __future__ import annotations

from collections.abc import Iterable

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import hookimpl

from ._declarations import rocm_kernel_specs
from ._detect import detect_rocm


__all__ = ["KERNELS_CORE_PLUGIN_API", "kernels_core_detect_devices", "kernels_core_kernels"]

# The kernels-core plugin API this plugin is written for (kernels_core.plugin.PLUGIN_API_VERSION).
KERNELS_CORE_PLUGIN_API = "1.0"


@hookimpl
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    """The ROCm backend and its AMD devices (none on CPU-only or CUDA builds of torch)."""
    return detect_rocm()


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    """Liger kernels per gfx architecture and PyTorch-native kernels for the ``rocm`` backend."""
    return rocm_kernel_specs()
