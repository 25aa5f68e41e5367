"""The plugin manager kernelize, the listings and users hold: the plugins of one process (or one test).

It keeps two concerns apart and adds none of its own: :class:`~._loading.PluginLoader` decides which plugins load
(entry points, the environment's allow and block lists) and collects what they declare, and the
:class:`~._declarations.Declarations` that collection gives answer every query. What went wrong with plugins is
said by :mod:`._diagnostics`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Iterable
from types import ModuleType

import pluggy

from .._types import BackendInfo
from .._types import KernelSpec
from ._diagnostics import kernel_problems
from ._loading import PluginLoader
from ._records import PluginInfo
from ._records import PluginStatus
from ._records import ProvidedKernel
from ._records import ProvidedKind


__all__ = ["KernelsPluginManager", "get_plugin_manager", "reset_plugin_manager"]


class KernelsPluginManager:
    """The plugins of one process (or one test), their declarations, and who declared what.

    Example:
        >>> pm = KernelsPluginManager(load_entrypoints=False)
        >>> [p.name for p in pm.plugins]
        []

    Args:
        load_entrypoints: discover plugins from installed distributions (group ``kernels_core.plugins``).
        strict: raise :class:`PluginError` instead of skipping a broken plugin; defaults to the
            ``KERNELS_CORE_STRICT_PLUGINS`` environment switch.
        allow: only these plugin names load (plus ``builtin``); defaults to ``KERNELS_CORE_PLUGINS``.
        block: these plugin names do not load; defaults to ``KERNELS_CORE_DISABLE_PLUGINS``.
    """

    def __init__(
        self,
        *,
        load_entrypoints: bool = True,
        strict: bool | None = None,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
    ) -> None:
        self.loader = PluginLoader(strict=strict, allow=allow, block=block)
        if load_entrypoints:
            self.loader.load_entrypoints()

    # -- loading: which plugins are in -------------------------------------------------------------------

    @property
    def strict(self) -> bool:
        return self.loader.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.loader.strict = value

    @property
    def allow(self) -> frozenset[str] | None:
        return self.loader.allow

    @property
    def block(self) -> frozenset[str]:
        return self.loader.block

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        return self.loader.hooks

    def load_entrypoints(self) -> None:
        """Import and register every plugin advertised under the ``kernels_core.plugins`` entry-point group."""
        self.loader.load_entrypoints()

    def register(self, plugin: ModuleType | object, name: str, *, distribution: str | None = None,
                 version: str | None = None) -> PluginInfo:
        """Register an in-process plugin object or module (tests, notebooks, frameworks embedding kernels)."""
        return self.loader.register(plugin, name, distribution=distribution, version=version)

    def unregister(self, name: str) -> None:
        self.loader.unregister(name)

    def invalidate(self) -> None:
        """Forget collected declarations so the next query asks the plugins again."""
        self.loader.invalidate()

    # -- queries: what they declare -----------------------------------------------------------------------

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, loaded or not (refused entry points included), sorted by name."""
        self.loader.declarations()
        return sorted([*self.loader.infos.values(), *self.loader.refused],
                      key=lambda info: (info.name, info.status != PluginStatus.LOADED))

    @property
    def conflicts(self) -> list[str]:
        """Name clashes: entry-point names advertised twice or reserved, kinds, kernel ids and priorities."""
        declared = self.loader.declarations()
        return [*self.loader.conflicts, *declared.conflicts]

    def info(self, name: str) -> PluginInfo:
        return self.loader.infos[name]

    def backends(self) -> list[tuple[BackendInfo, PluginInfo]]:
        """Detected backends, highest priority first; ties break by backend name."""
        return self.loader.declarations().backends()

    def layer_kinds(self) -> dict[str, ProvidedKind]:
        return self.loader.declarations().layer_kinds()

    def kernels(self) -> list[ProvidedKernel]:
        """Declared kernels, in a deterministic order: kind, then priority (high first), plugin, id."""
        return self.loader.declarations().kernels()

    def detectable_backends(self) -> frozenset[str]:
        """Backend names some loaded plugin's detect hook reports, with or without devices, plus ``any``."""
        return self.loader.declarations().detectable_backends()

    def plugin_problems(self, name: str) -> list[str]:
        """Problems of loaded plugin ``name`` that did not stop it and concern no single kernel (a hook returning
        None, an unknown ``KERNELS_CORE_*`` attribute), for ``kernels-core check``."""
        return self.loader.declarations().plugin_problems(name)

    def rejected_kernels(self) -> list[tuple[KernelSpec, PluginInfo, str]]:
        """Kernels dropped from loaded plugins (a variant their kind lacks...), with the reason."""
        return list(self.loader.declarations().rejected)

    def kernel_problems(self, *, locate_impls: bool = True) -> dict[str, list[tuple[str, str]]]:
        """Why listed kernels will not (or may not) be used (:func:`~._diagnostics.kernel_problems`)."""
        return kernel_problems(self.loader.declarations(), locate_impls=locate_impls)

    def bind_hook_of(self, plugin_name: str) -> Callable[..., object] | None:
        """``kernels_core_bind_kernel`` as pluggy calls it on plugin ``plugin_name``'s implementations alone
        (``firstresult``, its wrappers included), or None where that plugin implements none."""
        hooks = self.loader.hooks
        plugin = hooks.get_plugin(plugin_name)
        hook = hooks.hook.kernels_core_bind_kernel
        if plugin is None or not any(impl.plugin is plugin for impl in hook.get_hookimpls()):
            return None
        others = [other for _name, other in hooks.list_name_plugin() if other is not plugin]
        return hooks.subset_hook_caller("kernels_core_bind_kernel", remove_plugins=others)


_GLOBAL: KernelsPluginManager | None = None
_GLOBAL_LOCK = threading.Lock()


def get_plugin_manager() -> KernelsPluginManager:
    """The process-wide plugin manager, created on first use from installed entry points."""
    global _GLOBAL
    with _GLOBAL_LOCK:
        if _GLOBAL is None:
            _GLOBAL = KernelsPluginManager()
        return _GLOBAL


def reset_plugin_manager(manager: KernelsPluginManager | None = None) -> KernelsPluginManager | None:
    """Replace the process-wide manager (``None`` rediscovers on next use); returns the previous one."""
    global _GLOBAL
    with _GLOBAL_LOCK:
        previous, _GLOBAL = _GLOBAL, manager
        return previous
