"""What the core records about plugins: who they are and their status, what each provides, and what went wrong in
a plugin's code (:class:`Fault`).

Example:
    >>> info = PluginInfo(name="mine", module="my_pkg.plugin", distribution="my-pkg", version="1.0")
    >>> info.origin
    'my-pkg 1.0'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from .._types import BackendInfo
from .._types import KernelSpec
from .._types import LayerKind
from .._types import StatusEnum


__all__ = [
    "Contribution",
    "Fault",
    "KernelProblem",
    "PluginInfo",
    "PluginStatus",
    "ProvidedKernel",
    "ProvidedKind",
    "canonical_distribution",
    "replace_info",
]


def canonical_distribution(distribution: str | None) -> str | None:
    return re.sub(r"[-_.]+", "-", distribution).lower() if distribution else None


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


@dataclass(frozen=True)
class Fault:
    """What went wrong in one plugin's code: the plugin, the problem, the exception if one was raised.

    A hook implementation's fault (:mod:`._isolation`) skips its plugin unless it is ``soft`` (a hook returned
    ``None``); kernelize's (:class:`~._diagnostics.PluginFaults`) name the ``subject`` (a kernel id, or
    ``kind:<name>``) and its layer ``kind``, and leave the modules concerned on another kernel or their own forward.
    """

    plugin: str
    problem: str
    error: BaseException | None = None
    soft: bool = False
    subject: str = ""
    kind: str = ""


def replace_info(info: PluginInfo, **changes: object) -> PluginInfo:
    return replace(info, **changes)  # type: ignore[arg-type]
