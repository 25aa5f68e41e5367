"""The kernels-core entry point of kernels-npu (``kernels_core.plugins: npu``).

Importing this module is cheap and cannot fail on a host without Ascend: it imports kernels-core's value types
only. torch_npu is imported lazily by detection and by the kernels themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import LayerKind
from kernels_core.plugin import hookimpl


__all__ = [
    "KERNELS_CORE_PLUGIN_API",
    "kernels_core_detect_devices",
    "kernels_core_kernels",
    "kernels_core_layer_kinds",
]

# The kernels-core plugin API this plugin is written for (kernels_core.plugin.PLUGIN_API_VERSION).
KERNELS_CORE_PLUGIN_API = "1.0"


@hookimpl
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    """The ``npu`` backend and its devices; no devices (reason logged at DEBUG) when torch_npu is unusable."""
    from ._detect import detect_npu

    return [detect_npu()]


@hookimpl
def kernels_core_layer_kinds() -> Iterable[LayerKind]:
    """The ``attention`` kind (npu_fusion_attention replaces a module's attention function, per instance)."""
    from ._specs import attention_kind

    return [attention_kind()]


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    """The NPU kernels, as lazy declarations (see :func:`kernels_npu._specs.kernel_specs`)."""
    from ._specs import kernel_specs

    return kernel_specs()
