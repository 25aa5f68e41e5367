"""Loading plugins from entry points and collecting what they declare, one plugin at a time.

pluggy's own ``load_setuptools_entrypoints`` imports every plugin with no error isolation and its hook calls
stop at the first exception, so this module loads each entry point and calls each plugin's hooks separately:
a plugin that fails to import, raises in a hook or declares malformed data is skipped as a whole, with one
warning naming it, its distribution and version, and every other plugin keeps working.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from importlib import metadata as importlib_metadata
from types import ModuleType

import pluggy

from . import _hookspecs
from ._config import env_flag
from ._types import BackendInfo
from ._types import KernelSpec
from ._types import LayerKind


__all__ = [
    "ENTRY_POINT_GROUP",
    "KernelsPluginManager",
    "PluginError",
    "PluginInfo",
    "ProvidedKernel",
    "ProvidedKind",
    "get_plugin_manager",
    "reset_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kernels_core.plugins"
ENV_STRICT = "KERNELS_CORE_STRICT_PLUGINS"
ENV_ALLOW = "KERNELS_CORE_PLUGINS"
ENV_BLOCK = "KERNELS_CORE_DISABLE_PLUGINS"
ENV_TRACE = "KERNELS_CORE_TRACE_PLUGINS"
# The built-in plugin declares the layer kinds and the default binder; without it nothing can be matched.
UNBLOCKABLE = frozenset({"builtin"})


class PluginError(RuntimeError):
    """A plugin could not be loaded or used. Raised only in strict mode; otherwise logged once."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin


@dataclass(frozen=True)
class PluginInfo:
    """What the core knows about one plugin, for listings, reports and error messages."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    status: str = "loaded"
    reason: str | None = None

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
class _Contribution:
    backends: list[BackendInfo] = field(default_factory=list)
    kinds: list[LayerKind] = field(default_factory=list)
    kernels: list[KernelSpec] = field(default_factory=list)


def _env_list(name: str) -> frozenset[str] | None:
    """A comma-separated list of names; ``None`` when unset or blank. Names are checked against what is installed
    when kernelize checks its configuration (``kernels_core._config_check``)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _env_flag(name: str) -> bool:
    """A boolean switch, off when unset; any value but the documented ones raises ``ConfigError``."""
    return bool(env_flag(name))


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
        self.strict = _env_flag(ENV_STRICT) if strict is None else strict
        self.allow = frozenset(allow) if allow is not None else _env_list(ENV_ALLOW)
        self.block = frozenset(block) if block is not None else (_env_list(ENV_BLOCK) or frozenset())
        self._pm = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(_hookspecs)
        if _env_flag(ENV_TRACE):
            self._pm.trace.root.setwriter(lambda line: logger.info("pluggy: %s", line.rstrip()))
            self._pm.enable_tracing()
        self._infos: dict[str, PluginInfo] = {}
        self._lock = threading.RLock()
        self._collected: dict[str, _Contribution] | None = None
        self.conflicts: list[str] = []
        if load_entrypoints:
            self.load_entrypoints()

    # -- loading -----------------------------------------------------------------------------------------

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, loaded or not, sorted by name."""
        self._ensure_collected()
        return sorted(self._infos.values(), key=lambda info: info.name)

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        return self._pm

    def load_entrypoints(self) -> None:
        """Import and register every plugin advertised under the ``kernels_core.plugins`` entry-point group."""
        entry_points = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                module=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            if ep.name in self._infos:
                self._note_conflict(
                    f"plugin name {ep.name!r} is advertised twice ({self._infos[ep.name].origin} and "
                    f"{info.origin}); keeping the first"
                )
                continue
            skip_reason = self._blocked_reason(ep.name)
            if skip_reason:
                self._infos[ep.name] = _replace(info, status="blocked", reason=skip_reason)
                logger.debug("plugin %r not loaded: %s", ep.name, skip_reason)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must be isolated
                self._fail(info, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}", exc)
                continue
            self._register(plugin, info)

    def register(
        self,
        plugin: ModuleType | object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginInfo:
        """Register an in-process plugin object or module (tests, notebooks, frameworks embedding kernels)."""
        module_name = getattr(plugin, "__name__", type(plugin).__name__)
        info = PluginInfo(name=name, module=module_name, distribution=distribution, version=version)
        if name in self._infos and self._infos[name].status == "loaded":
            raise ValueError(f"a plugin named {name!r} is already registered ({self._infos[name].origin})")
        skip_reason = self._blocked_reason(name)
        if skip_reason:
            info = _replace(info, status="blocked", reason=skip_reason)
            self._infos[name] = info
            return info
        self._register(plugin, info)
        return self._infos[name]

    def unregister(self, name: str) -> None:
        plugin = self._pm.get_plugin(name)
        if plugin is not None:
            self._pm.unregister(plugin)
        self._infos.pop(name, None)
        self.invalidate()

    def invalidate(self) -> None:
        """Forget collected declarations so the next query asks the plugins again."""
        with self._lock:
            self._collected = None
            self.conflicts = []
            for name, info in list(self._infos.items()):
                if info.status == "skipped":
                    self._infos[name] = _replace(info, status="loaded", reason=None)

    def _blocked_reason(self, name: str) -> str | None:
        if name in UNBLOCKABLE:
            return None
        if name in self.block:
            return f"blocked by {ENV_BLOCK} or the block argument"
        if self.allow is not None and name not in self.allow:
            return f"not in the allow-list ({ENV_ALLOW}={','.join(sorted(self.allow))})"
        return None

    def _register(self, plugin: object, info: PluginInfo) -> None:
        try:
            self._pm.register(plugin, name=info.name)
            self._check_pending(info.name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors, bad hook signatures
            if self._pm.get_plugin(info.name) is not None:
                self._pm.unregister(name=info.name)
            self._fail(info, f"invalid hook implementation: {exc}", exc)
            return
        self._infos[info.name] = info
        self.invalidate()

    def _check_pending(self, name: str) -> None:
        # pluggy's check_pending() covers every plugin; doing it per registration names the culprit.
        known = {spec for spec in dir(_hookspecs) if spec.startswith("kernels_core_")}
        plugin = self._pm.get_plugin(name)
        for attr in dir(plugin):
            if not attr.startswith("kernels_core_") or attr in known:
                continue
            if self._pm.parse_hookimpl_opts(plugin, attr) is not None:
                raise pluggy.PluginValidationError(
                    plugin,
                    f"unknown hook {attr!r} (misspelled?); known hooks: {', '.join(sorted(known))}",
                )
        self._pm.check_pending()

    def _fail(self, info: PluginInfo, reason: str, exc: BaseException | None = None) -> None:
        self._infos[info.name] = _replace(info, status="failed", reason=reason)
        message = f"kernels-core plugin {info.name!r} ({info.origin}) skipped: {reason}"
        if self.strict:
            raise PluginError(info.name, message) from exc
        logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    def _note_conflict(self, message: str) -> None:
        self.conflicts.append(message)
        logger.warning("kernels-core plugin conflict: %s", message)

    # -- collecting --------------------------------------------------------------------------------------

    def _ensure_collected(self) -> dict[str, _Contribution]:
        with self._lock:
            if self._collected is None:
                self._collected = self._collect()
            return self._collected

    def _collect(self) -> dict[str, _Contribution]:
        contributions: dict[str, _Contribution] = {}
        hooks = (
            ("kernels_core_detect_devices", BackendInfo, "backends"),
            ("kernels_core_layer_kinds", LayerKind, "kinds"),
            ("kernels_core_kernels", KernelSpec, "kernels"),
        )
        for name in sorted(n for n, i in self._infos.items() if i.status == "loaded"):
            plugin = self._pm.get_plugin(name)
            contribution = _Contribution()
            try:
                for hook_name, expected, slot in hooks:
                    function = getattr(plugin, hook_name, None)
                    if function is None or self._pm.parse_hookimpl_opts(plugin, hook_name) is None:
                        continue
                    try:
                        result = function()
                        values = list(result or ())
                    except Exception as exc:  # noqa: BLE001 - a raising hook skips only its plugin
                        raise _SkipPlugin(f"hook {hook_name} raised {type(exc).__name__}: {exc}") from exc
                    for value in values:
                        if not isinstance(value, expected):
                            raise _SkipPlugin(
                                f"hook {hook_name} returned {type(value).__name__} {value!r}; "
                                f"expected {expected.__name__}"
                            )
                    getattr(contribution, slot).extend(values)
            except _SkipPlugin as skip:
                self._infos[name] = _replace(self._infos[name], status="skipped", reason=str(skip))
                info = self._infos[name]
                message = f"kernels-core plugin {name!r} ({info.origin}) skipped: {skip}"
                if self.strict:
                    raise PluginError(name, message) from skip.__cause__
                logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
                continue
            contributions[name] = contribution
        self._validate_cross_plugin(contributions)
        return contributions

    def _validate_cross_plugin(self, contributions: dict[str, _Contribution]) -> None:
        kind_names = {k.name for c in contributions.values() for k in c.kinds}
        for name in sorted(contributions):
            bad = [s.id for s in contributions[name].kernels if s.kind not in kind_names]
            if bad:
                reason = f"kernels {bad} name unknown layer kinds; known kinds: {sorted(kind_names)}"
                self._infos[name] = _replace(self._infos[name], status="skipped", reason=reason)
                message = f"kernels-core plugin {name!r} ({self._infos[name].origin}) skipped: {reason}"
                if self.strict:
                    raise PluginError(name, message)
                logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
                del contributions[name]
        # A layer kind has one owner: the core's own kinds always win; between two plugins the one sorting
        # first keeps it and the other plugin is skipped whole, since its kernels follow another calling
        # convention than the kept kind's adapter would use.
        owners: dict[str, str] = {}
        for name in sorted(contributions, key=lambda n: (n != "builtin", n)):
            for kind in contributions[name].kinds:
                owner = owners.setdefault(kind.name, name)
                if owner != name:
                    reason = (f"declares layer kind {kind.name!r}, already declared by plugin {owner!r}; "
                              "rename the kind")
                    self._infos[name] = _replace(self._infos[name], status="skipped", reason=reason)
                    message = f"kernels-core plugin {name!r} ({self._infos[name].origin}) skipped: {reason}"
                    self._note_conflict(message)
                    if self.strict:
                        raise PluginError(name, message)
                    del contributions[name]
                    break
        seen_ids: dict[str, str] = {}
        seen_kinds: dict[str, str] = {}
        seen_priority: dict[tuple[str, str, int], str] = {}
        for name in sorted(contributions):
            for kind in contributions[name].kinds:
                if kind.name in seen_kinds:
                    self._note_conflict(
                        f"layer kind {kind.name!r} declared by {seen_kinds[kind.name]!r} and {name!r}; "
                        f"using {seen_kinds[kind.name]!r}'s"
                    )
                else:
                    seen_kinds[kind.name] = name
            kept = []
            for spec in contributions[name].kernels:
                if spec.id in seen_ids:
                    self._note_conflict(
                        f"kernel id {spec.id!r} declared by {seen_ids[spec.id]!r} and {name!r}; "
                        f"using {seen_ids[spec.id]!r}'s"
                    )
                    continue
                seen_ids[spec.id] = name
                key = (spec.kind, spec.backend, spec.priority)
                if key in seen_priority and seen_priority[key] != name:
                    self._note_conflict(
                        f"plugins {seen_priority[key]!r} and {name!r} both declare priority {spec.priority} for "
                        f"kind {spec.kind!r} on backend {spec.backend!r}; ties break by plugin name, then kernel id"
                    )
                seen_priority.setdefault(key, name)
                kept.append(spec)
            contributions[name].kernels = kept
            contributions[name].kinds = [k for k in contributions[name].kinds if seen_kinds[k.name] == name]

    # -- queries -----------------------------------------------------------------------------------------

    def info(self, name: str) -> PluginInfo:
        return self._infos[name]

    def backends(self) -> list[tuple[BackendInfo, PluginInfo]]:
        """Detected backends, highest priority first; ties break by backend name."""
        collected = self._ensure_collected()
        pairs = [(b, self._infos[name]) for name, c in collected.items() for b in c.backends]
        return sorted(pairs, key=lambda pair: (-pair[0].priority, pair[0].backend))

    def layer_kinds(self) -> dict[str, ProvidedKind]:
        collected = self._ensure_collected()
        return {k.name: ProvidedKind(k, self._infos[name]) for name, c in collected.items() for k in c.kinds}

    def kernels(self) -> list[ProvidedKernel]:
        """Declared kernels, in a deterministic order: kind, then priority (high first), plugin, id."""
        collected = self._ensure_collected()
        provided = [ProvidedKernel(s, self._infos[name]) for name, c in collected.items() for s in c.kernels]
        return sorted(provided, key=lambda p: (p.spec.kind, -p.spec.priority, p.plugin.name, p.spec.id))

    def default_binding(self, **kwargs: object) -> object:
        """The built-in plugin's default binding (``trylast``), used when the owning plugin has no opinion."""
        builtin = self._pm.get_plugin("builtin")
        if builtin is None:
            from ._builtin import kernels_core_bind_kernel

            return kernels_core_bind_kernel(**kwargs)
        return builtin.kernels_core_bind_kernel(**kwargs)

    def bind_hook_of(self, plugin_name: str) -> object | None:
        """The owning plugin's ``kernels_core_bind_kernel`` implementation, if it has one."""
        plugin = self._pm.get_plugin(plugin_name)
        # Some pluggy versions' parse_hookimpl_opts raise AttributeError for a missing attribute.
        if plugin is None or not hasattr(plugin, "kernels_core_bind_kernel"):
            return None
        if self._pm.parse_hookimpl_opts(plugin, "kernels_core_bind_kernel") is None:
            return None
        return plugin.kernels_core_bind_kernel


class _SkipPlugin(Exception):
    pass


def _replace(info: PluginInfo, **changes: object) -> PluginInfo:
    from dataclasses import replace

    return replace(info, **changes)


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
