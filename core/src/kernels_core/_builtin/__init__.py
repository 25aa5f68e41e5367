"""The core's built-in plugin: the host CPU backend and the core layer kinds.

Registered through the same ``kernels_core.plugins`` entry-point group as every vendor plugin (entry name
``builtin``). It cannot be blocked, because without its layer kinds nothing can be matched.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

from .._kinds import CORE_KINDS
from .._plugins._hookspec import PLUGIN_API_VERSION
from .._plugins._hookspec import hookimpl
from .._types import BackendInfo
from .._types import DeviceInfo
from .._types import LayerKind


__all__ = ["KERNELS_CORE_PLUGIN_API", "kernels_core_detect_devices", "kernels_core_layer_kinds"]

KERNELS_CORE_PLUGIN_API = PLUGIN_API_VERSION


def _cpu_name() -> str:
    name = platform.processor() or platform.machine() or "CPU"
    return f"{name} ({os.cpu_count() or '?'} cores)"


@hookimpl
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    return [BackendInfo(backend="cpu", device_type="cpu", devices=(DeviceInfo(0, _cpu_name()),), priority=0)]


@hookimpl
def kernels_core_layer_kinds() -> Iterable[LayerKind]:
    return CORE_KINDS

