"""The core's built-in plugin: the host CPU backend, the core layer kinds and the default binding.

Registered through the same ``kernels_core.plugins`` entry-point group as every vendor plugin (entry name
``builtin``). It cannot be blocked, because without its layer kinds nothing can be matched.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

from .._hookspecs import hookimpl
from .._kinds import CORE_KINDS
from .._types import BackendInfo
from .._types import Binding
from .._types import DeviceInfo
from .._types import KernelSpec
from .._types import LayerKind
from .._types import Match


__all__ = ["kernels_core_bind_kernel", "kernels_core_detect_devices", "kernels_core_layer_kinds"]


def _cpu_name() -> str:
    name = platform.processor() or platform.machine() or "CPU"
    return f"{name} ({os.cpu_count() or '?'} cores)"


@hookimpl
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    return [BackendInfo(backend="cpu", device_type="cpu", devices=(DeviceInfo(0, _cpu_name()),), priority=0)]


@hookimpl
def kernels_core_layer_kinds() -> Iterable[LayerKind]:
    return CORE_KINDS


@hookimpl(trylast=True)
def kernels_core_bind_kernel(module: object, match: Match, kernel: KernelSpec, forward: object) -> Binding:
    return Binding({"forward": forward})
