"""kernels-core: pick the best kernel for every layer of a model, per instance and per device, reversibly.

Example:
    >>> import torch, kernels_core
    >>> model = torch.nn.Sequential(torch.nn.LayerNorm(16))
    >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
    >>> kernels_core.get_report(model).mode
    'INFERENCE'

``import kernels_core`` imports neither torch nor any kernel library; ``kernelize`` and friends load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

from ._config import KernelsConfig
from ._config import KindConfig
from ._config import load_config
from ._errors import ConfigError
from ._errors import ConfigWarning
from ._errors import KernelFallbackWarning
from ._errors import KernelizeError
from ._errors import PluginError
from ._plugins._hookspec import hookimpl
from ._plugins._manager import KernelsPluginManager
from ._plugins._manager import get_plugin_manager
from ._plugins._manager import reset_plugin_manager
from ._plugins._records import PluginInfo
from ._plugins._records import PluginStatus
from ._report import KernelizeReport
from ._report import ReportEntry
from ._types import BackendInfo
from ._types import Binding
from ._types import CapabilityRange
from ._types import Decline
from ._types import DeviceInfo
from ._types import KernelSpec
from ._types import LayerKind
from ._types import Match
from ._types import Mode
from ._types import Supports


if TYPE_CHECKING:
    from ._kernelize import get_report
    from ._kernelize import kernelize
    from ._kernelize import unkernelize

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "Binding",
    "CapabilityRange",
    "ConfigError",
    "ConfigWarning",
    "Decline",
    "DeviceInfo",
    "KernelFallbackWarning",
    "KernelSpec",
    "KernelizeError",
    "KernelizeReport",
    "KernelsConfig",
    "KernelsPluginManager",
    "KindConfig",
    "LayerKind",
    "Match",
    "Mode",
    "PluginError",
    "PluginInfo",
    "PluginStatus",
    "ReportEntry",
    "Supports",
    "detect_devices",
    "get_plugin_manager",
    "get_report",
    "hookimpl",
    "kernelize",
    "list_kernels",
    "list_plugins",
    "load_config",
    "reset_plugin_manager",
    "unkernelize",
]

_LAZY = {"kernelize", "unkernelize", "get_report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _kernelize

        return getattr(_kernelize, name)
    raise AttributeError(f"module 'kernels_core' has no attribute {name!r}")


def detect_devices(*, plugin_manager: KernelsPluginManager | None = None) -> list[BackendInfo]:
    """Backends the installed plugins detected, highest priority first (empty device tuples included)."""
    pm = plugin_manager or get_plugin_manager()
    return [backend for backend, _plugin in pm.backends()]


def list_plugins(*, plugin_manager: KernelsPluginManager | None = None) -> list[PluginInfo]:
    """Every plugin seen: loaded, blocked, refused, failed or skipped, with the reason."""
    return (plugin_manager or get_plugin_manager()).plugins


def list_kernels(*, backend: str | None = None, plugin_manager: KernelsPluginManager | None = None
                 ) -> list[tuple[KernelSpec, PluginInfo]]:
    """Declared kernels (nothing is imported), optionally only those usable on ``backend`` (portable included)."""
    pm = plugin_manager or get_plugin_manager()
    return [(p.spec, p.plugin) for p in pm.kernels()
            if backend is None or p.spec.backend in (backend, "any")]
