"""What the core records about plugins and their kernels: plugin listings, provided kernels and kinds, fallbacks.

Example:
    >>> info = PluginInfo(name="mine", module="my_pkg.plugin", distribution="my-pkg", version="1.0")
    >>> info.origin
    'my-pkg 1.0'
"""

from __future__ import annotations

import re
import threading
import warnings
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from ._hints import user_stacklevel
from ._types import BackendInfo
from ._types import KernelSpec
from ._types import LayerKind
from ._types import StatusEnum


__all__ = [
    "ENV_STRICT",
    "Contribution",
    "KernelFallbackWarning",
    "PluginError",
    "PluginInfo",
    "ProvidedKernel",
    "ProvidedKind",
    "canonical_distribution",
    "recorded_fallbacks",
    "replace_info",
    "reset_fallbacks",
    "warn_fallback",
]


ENV_STRICT = "KERNELS_CORE_STRICT_PLUGINS"


class KernelFallbackWarning(UserWarning):
    """An automatic choice fell back: a kernel or a layer kind could not be used, so something else runs.

    Issued once per kernel (or kind) and cause in a process; the message names the plugin, its distribution,
    the kernel id and the cause. Turn it into an error with a warnings filter:
    ``warnings.filterwarnings("error", category=kernels_core.KernelFallbackWarning)`` (Python's ``-W`` option
    cannot name it: it is checked before kernels-core is imported).
    """


# Process-wide: what fell back and why, for listings; which (plugin, subject, cause) were already warned about.
_FALLBACKS: dict[tuple[str, str], str] = {}
_WARNED: set[tuple[str, str, str]] = set()
_FALLBACK_LOCK = threading.Lock()


def warn_fallback(plugin: PluginInfo, subject: str, cause: str, message: str) -> None:
    """Record that ``subject`` (a kernel id, or ``kind:<name>``) of ``plugin`` fell back; warn once per cause."""
    key = (plugin.name, subject, cause)
    with _FALLBACK_LOCK:
        _FALLBACKS[(plugin.name, subject)] = cause
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, KernelFallbackWarning, stacklevel=user_stacklevel())


def recorded_fallbacks() -> dict[tuple[str, str], str]:
    """``(plugin, kernel id or kind:<name>) -> cause`` for every fallback seen in this process."""
    with _FALLBACK_LOCK:
        return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget recorded fallbacks and warnings (tests: each test starts as a fresh process would)."""
    with _FALLBACK_LOCK:
        _FALLBACKS.clear()
        _WARNED.clear()


def canonical_distribution(distribution: str | None) -> str | None:
    return re.sub(r"[-_.]+", "-", distribution).lower() if distribution else None


class PluginError(RuntimeError):
    """A plugin could not be loaded or used. Raised only in strict mode; otherwise logged once."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin


class PluginStatus(StatusEnum):
    """Whether a plugin is in use (:attr:`PluginInfo.status`); a string too, so it compares, prints and encodes as
    its value.

    Example:
        >>> PluginStatus.LOADED == "loaded", f"{PluginStatus.REFUSED}"
        (True, 'refused')
    """

    LOADED = "loaded"
    BLOCKED = "blocked"
    REFUSED = "refused"
    FAILED = "failed"
    SKIPPED = "skipped"


class KernelProblem(StatusEnum):
    """Why a listed kernel will not (or may not) be used (``kernels-core kernels``, ``kernel_problems``)."""

    UNDETECTABLE_BACKEND = "undetectable backend"
    CANNOT_RUN_HERE = "cannot run here"
    FELL_BACK = "fell back"
    IMPL_MISSING = "impl missing"
    REJECTED = "rejected"


@dataclass(frozen=True)
class PluginInfo:
    """What the core knows about one plugin, for listings, reports and error messages.

    ``status`` is ``loaded``, ``blocked`` (allow or block list: never imported), ``refused`` (a reserved or
    already taken name: never imported; or a plugin API version this kernels-core does not provide: imported, no
    hook called), ``failed`` (import or hook validation failed) or ``skipped`` (its declarations were malformed or
    clash with another plugin's). ``reason`` says why; a ``loaded`` plugin with a reason has a problem that did not
    stop it (a hook returned ``None``, a kernel was rejected). ``api_version`` is the plugin API version the
    plugin states (``KERNELS_CORE_PLUGIN_API``, see :data:`kernels_core.plugin.PLUGIN_API_VERSION`), if any.
    """

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    status: PluginStatus = PluginStatus.LOADED
    reason: str | None = None
    api_version: str | None = None

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"{self.distribution} {self.version or '?'}"
        return "registered in-process"


@dataclass(frozen=True)
class ProvidedKernel:
    spec: KernelSpec
    plugin: PluginInfo


@dataclass(frozen=True)
class ProvidedKind:
    kind: LayerKind
    plugin: PluginInfo


@dataclass
class Contribution:
    backends: list[BackendInfo] = field(default_factory=list)
    kinds: list[LayerKind] = field(default_factory=list)
    kernels: list[KernelSpec] = field(default_factory=list)


def replace_info(info: PluginInfo, **changes: object) -> PluginInfo:
    return replace(info, **changes)  # type: ignore[arg-type]
