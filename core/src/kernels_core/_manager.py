"""Loading plugins from entry points and collecting what they declare through pluggy's hooks.

pluggy's own ``load_setuptools_entrypoints`` imports every plugin with no error isolation, so this module loads
each entry point itself; hooks are called through pluggy (``pm.hook``) with each implementation isolated
(:mod:`kernels_core._pluggy`). A plugin that fails to import, states an incompatible plugin API version, raises in
a hook or declares malformed data is skipped as a whole, with one warning naming it, its distribution and version,
and every other plugin keeps working.

The names ``builtin`` and ``portable`` belong to the kernels-core distribution: another distribution advertising
them is refused before its module is imported, so it can neither replace the core's layer kinds nor run code.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from collections.abc import Iterable
from importlib import metadata as importlib_metadata
from types import ModuleType

import pluggy

from ._config import env_flag
from ._hints import did_you_mean
from ._hookspec import API_ATTRIBUTE
from ._hookspec import PLUGIN_API_VERSION
from ._hookspec import PROJECT_NAME
from ._hookspec import Hooks
from ._pluggy import IsolatingPluginManager
from ._plugin_checks import cross_check
from ._plugin_info import ENV_STRICT
from ._plugin_info import Contribution
from ._plugin_info import KernelFallbackWarning
from ._plugin_info import KernelProblem
from ._plugin_info import PluginError
from ._plugin_info import PluginInfo
from ._plugin_info import PluginStatus
from ._plugin_info import ProvidedKernel
from ._plugin_info import ProvidedKind
from ._plugin_info import canonical_distribution
from ._plugin_info import recorded_fallbacks
from ._plugin_info import replace_info
from ._plugin_info import warn_fallback
from ._refs import ref_problem
from ._types import ANY_BACKEND
from ._types import BackendInfo
from ._types import Binding
from ._types import KernelSpec
from ._types import LayerKind


__all__ = [
    "ENTRY_POINT_GROUP",
    "KernelFallbackWarning",
    "KernelsPluginManager",
    "PluginError",
    "PluginInfo",
    "ProvidedKernel",
    "ProvidedKind",
    "get_plugin_manager",
    "reset_plugin_manager",
]

# One logger for the package: what a user configures is `kernels_core`, never a private module.
logger = logging.getLogger("kernels_core")

ENTRY_POINT_GROUP = "kernels_core.plugins"
ENV_ALLOW = "KERNELS_CORE_PLUGINS"
ENV_BLOCK = "KERNELS_CORE_DISABLE_PLUGINS"
ENV_TRACE = "KERNELS_CORE_TRACE_PLUGINS"
# The built-in plugin declares the layer kinds; without it nothing can be matched.
UNBLOCKABLE = frozenset({"builtin"})
# Entry names only the kernels-core distribution may advertise, with the module each one must be.
CORE_DISTRIBUTION = "kernels-core"
RESERVED = {"builtin": "kernels_core._builtin", "portable": "kernels_core._builtin.portable"}
# The declaration hooks: the type of the values each returns a list of, and the Contribution slot they fill.
DECLARATIONS = {
    "kernels_core_detect_devices": (BackendInfo, "backends"),
    "kernels_core_layer_kinds": (LayerKind, "kinds"),
    "kernels_core_kernels": (KernelSpec, "kernels"),
}


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


def api_problem(stated: object) -> str | None:
    """Why a plugin stating plugin API version ``stated`` (None: it states none) cannot load here, or None.

    Example:
        >>> api_problem("1.7") is None, api_problem(None) is None
        (True, True)
        >>> api_problem("2.0")
        "written for kernels-core's plugin API 2.0, but this kernels-core provides 1.0: ..."
    """
    if stated is None:
        return None
    major = PLUGIN_API_VERSION.split(".")[0]
    parts = stated.split(".") if isinstance(stated, str) else []
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return (f"states {API_ATTRIBUTE} = {stated!r}, which is not a 'MAJOR.MINOR' version string such as "
                f"{PLUGIN_API_VERSION!r}")
    if parts[0] != major:
        return (f"written for kernels-core's plugin API {stated}, but this kernels-core provides "
                f"{PLUGIN_API_VERSION}: a plugin for API {parts[0]}.x does not load here. Install a release of the "
                f"plugin written for API {major}.x, or a kernels-core providing API {parts[0]}.x")
    return None


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
        self._pm = IsolatingPluginManager(PROJECT_NAME, {hook: kind for hook, (kind, _) in DECLARATIONS.items()})
        self._pm.add_hookspecs(Hooks)
        if _env_flag(ENV_TRACE):
            self._pm.trace.root.setwriter(lambda line: logger.info("pluggy: %s", line.rstrip()))
            self._pm.enable_tracing()
        self._infos: dict[str, PluginInfo] = {}
        self._lock = threading.RLock()
        self._collected: dict[str, Contribution] | None = None
        # Refused entry points (reserved or duplicate names): listed, never imported, never registered.
        self._refused: list[PluginInfo] = []
        # Name clashes found while loading survive invalidate(); those found while collecting are recomputed.
        self._load_conflicts: list[str] = []
        self._collect_conflicts: list[str] = []
        # Problems that did not stop a loaded plugin, per plugin, and kernels rejected, for this collection.
        self._soft_problems: dict[str, list[str]] = {}
        self._rejected: list[tuple[KernelSpec, PluginInfo, str]] = []
        self._warned: set[str] = set()
        if load_entrypoints:
            self.load_entrypoints()

    # -- loading -----------------------------------------------------------------------------------------

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen, loaded or not (refused entry points included), sorted by name."""
        self._ensure_collected()
        return sorted([*self._infos.values(), *self._refused],
                      key=lambda info: (info.name, info.status != PluginStatus.LOADED))

    @property
    def conflicts(self) -> list[str]:
        """Name clashes: entry-point names advertised twice or reserved, kinds, kernel ids and priorities."""
        self._ensure_collected()
        return [*self._load_conflicts, *self._collect_conflicts]

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
            if ep.name in RESERVED and canonical_distribution(info.distribution) != CORE_DISTRIBUTION:
                self._refuse(info, f"the plugin name {ep.name!r} is reserved for kernels-core's own plugin; "
                                   f"{info.origin} advertises it for {ep.value!r}, which was not imported. Rename "
                                   f"the entry point in that distribution's [project.entry-points."
                                   f"\"{ENTRY_POINT_GROUP}\"] table, or uninstall it")
                continue
            if ep.name in self._infos:
                self._refuse(info, f"the plugin name {ep.name!r} is already taken by {self._infos[ep.name].origin}; "
                                   f"{ep.value!r} was not imported. Rename one of the two entry points, or "
                                   "uninstall one distribution")
                continue
            skip_reason = self._blocked_reason(ep.name)
            if skip_reason:
                self._infos[ep.name] = replace_info(info, status=PluginStatus.BLOCKED, reason=skip_reason)
                logger.debug("plugin %r not loaded: %s", ep.name, skip_reason)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must be isolated
                self._fail(info, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}", exc)
                continue
            self._register(plugin, info)
        if "builtin" not in self._infos:
            # kernels-core's own entry points are missing (a source tree on sys.path, not installed): its layer
            # kinds are still needed, and no other distribution may stand in for them.
            from . import _builtin

            logger.debug("no kernels-core entry point named builtin; registering %s directly", RESERVED["builtin"])
            self._register(_builtin, PluginInfo(name="builtin", module=RESERVED["builtin"]))

    def _refuse(self, info: PluginInfo, reason: str) -> None:
        refused = replace_info(info, status=PluginStatus.REFUSED, reason=reason)
        self._refused.append(refused)
        message = f"kernels-core plugin {info.name!r} ({info.origin}) refused: {reason}"
        self._load_conflicts.append(message)
        if self.strict:
            raise PluginError(info.name, message)
        logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

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
        if name in RESERVED and module_name != RESERVED[name]:
            raise ValueError(f"the plugin name {name!r} is reserved for kernels-core's own {RESERVED[name]}; "
                             f"register {module_name!r} under another name")
        info = PluginInfo(name=name, module=module_name, distribution=distribution, version=version)
        if name in self._infos and self._infos[name].status == PluginStatus.LOADED:
            raise ValueError(f"a plugin named {name!r} is already registered ({self._infos[name].origin})")
        skip_reason = self._blocked_reason(name)
        if skip_reason:
            info = replace_info(info, status=PluginStatus.BLOCKED, reason=skip_reason)
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
            self._collect_conflicts = []
            self._soft_problems = {}
            self._rejected = []
            for name, info in list(self._infos.items()):
                if info.status == PluginStatus.SKIPPED or (info.status == PluginStatus.LOADED and info.reason):
                    self._infos[name] = replace_info(info, status=PluginStatus.LOADED, reason=None)

    def _blocked_reason(self, name: str) -> str | None:
        if name in UNBLOCKABLE:
            return None
        if name in self.block:
            return f"blocked by {ENV_BLOCK} or the block argument"
        if self.allow is not None and name not in self.allow:
            return f"not in the allow-list ({ENV_ALLOW}={','.join(sorted(self.allow))})"
        return None

    def _register(self, plugin: object, info: PluginInfo) -> None:
        stated = getattr(plugin, API_ATTRIBUTE, None)
        info = replace_info(info, api_version=stated if isinstance(stated, str) else None)
        problem = api_problem(stated)
        if problem is not None:
            self._infos[info.name] = replace_info(info, status=PluginStatus.REFUSED, reason=problem)
            message = f"kernels-core plugin {info.name!r} ({info.origin}) refused: {problem}"
            if self.strict:
                raise PluginError(info.name, message)
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
            return
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
        known = {spec for spec in dir(Hooks) if spec.startswith("kernels_core_")}
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
        for caller in self._pm.get_hookcallers(plugin) or ():
            if any(impl.plugin is plugin and impl.hookwrapper for impl in caller.get_hookimpls()):
                raise pluggy.PluginValidationError(
                    plugin, f"{caller.name} is an old-style hookwrapper=True wrapper; kernels-core takes new-style "
                            "wrappers only: @hookimpl(wrapper=True), returning the (edited) result")

    def _fail(self, info: PluginInfo, reason: str, exc: BaseException | None = None) -> None:
        self._infos[info.name] = replace_info(info, status=PluginStatus.FAILED, reason=reason)
        message = f"kernels-core plugin {info.name!r} ({info.origin}) skipped: {reason}"
        logger.debug("%s", message, exc_info=exc)
        if self.strict:
            raise PluginError(info.name, message) from exc
        logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    def _note_conflict(self, message: str) -> None:
        self._collect_conflicts.append(message)
        logger.warning("kernels-core plugin conflict: %s", message)

    def _soft_problem(self, name: str, problem: str) -> None:
        """A problem that does not stop a loaded plugin: warned once, shown as its reason, raised if strict."""
        self._soft_problems.setdefault(name, []).append(problem)
        message = f"kernels-core plugin {name!r} ({self._infos[name].origin}): {problem}"
        if self.strict:
            raise PluginError(name, message)
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    # -- collecting --------------------------------------------------------------------------------------

    def _ensure_collected(self) -> dict[str, Contribution]:
        with self._lock:
            if self._collected is None:
                self._collected = self._collect()
            return self._collected

    def _collect(self) -> dict[str, Contribution]:
        # Recomputed on every collection (a strict failure may have left a partial one behind).
        self._collect_conflicts, self._soft_problems, self._rejected = [], {}, []
        contributions = {name: Contribution() for name, i in sorted(self._infos.items())
                         if i.status == PluginStatus.LOADED}
        failed: dict[str, tuple[str, BaseException | None]] = {}
        for hook, (_type, slot) in DECLARATIONS.items():
            declared, faults = self._pm.declare(hook)
            for fault in faults:
                if fault.soft:
                    self._soft_problem(fault.plugin, fault.problem)
                else:
                    failed.setdefault(fault.plugin, (fault.problem, fault.error))
            for plugin, value in declared:
                if plugin in contributions:
                    getattr(contributions[plugin], slot).append(value)
        for name in sorted(contributions):
            for problem in _attribute_problems(self._pm.get_plugin(name)):
                self._soft_problem(name, problem)
        for name in sorted(failed):
            contributions.pop(name, None)
            self._skip(name, *failed[name])
        found = cross_check(contributions)
        for skip in found.skipped:
            self._skip(skip.plugin, skip.reason, clash=skip.clash)
        for conflict in found.conflicts:
            self._note_conflict(conflict)
        for name, spec, reason in found.rejected:
            # One kernel of a loaded plugin dropped (its others stay): listed, warned once, raised if strict.
            self._rejected.append((spec, self._infos[name], reason))
            self._soft_problem(name, f"kernel {spec.id!r} ignored: {reason}")
        for name, problems in self._soft_problems.items():
            if self._infos[name].status == PluginStatus.LOADED:
                self._infos[name] = replace_info(self._infos[name], reason="; ".join(problems))
        return found.kept

    def _skip(self, name: str, reason: str, error: BaseException | None = None, *, clash: bool = False) -> None:
        """Skip a loaded plugin whole for this collection: warned (as a conflict for a clash), raised if strict."""
        self._infos[name] = replace_info(self._infos[name], status=PluginStatus.SKIPPED, reason=reason)
        message = f"kernels-core plugin {name!r} ({self._infos[name].origin}) skipped: {reason}"
        if error is not None:
            logger.debug("%s", message, exc_info=error)
        if clash:
            self._note_conflict(message)
        if self.strict:
            raise PluginError(name, message) from error
        if not clash:
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

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

    def plugin_problems(self, name: str) -> list[str]:
        """Problems of loaded plugin ``name`` that did not stop it and concern no single kernel (a hook returning
        None, an unknown ``KERNELS_CORE_*`` attribute), for ``kernels-core check``."""
        self._ensure_collected()
        rejected = {f"kernel {spec.id!r} ignored: {reason}" for spec, info, reason in self._rejected
                    if info.name == name}
        return [problem for problem in self._soft_problems.get(name, []) if problem not in rejected]

    def rejected_kernels(self) -> list[tuple[KernelSpec, PluginInfo, str]]:
        """Kernels dropped from loaded plugins (a variant their kind lacks...), with the reason."""
        self._ensure_collected()
        return list(self._rejected)

    def detectable_backends(self) -> frozenset[str]:
        """Backend names some loaded plugin's detect hook reports, with or without devices, plus ``any``."""
        return frozenset({b.backend for b, _ in self.backends()} | {ANY_BACKEND})

    def kernel_problems(self, *, locate_impls: bool = True) -> dict[str, list[tuple[str, str]]]:
        """Why listed kernels will not (or may not) be used: kernel id -> ``(status, detail)`` pairs.

        Statuses: ``undetectable backend`` (no installed plugin detects the kernel's backend, so it is never
        chosen), ``cannot run here`` (no device of its backend is present, or a capability, architecture or
        requirement is not met: what ``kernels-core check`` skips it for), ``fell back`` (recorded in this process)
        and, with ``locate_impls``, ``impl missing`` (the ``impl`` module cannot be found). Imports nothing new.
        """
        from ._refs import locate_problem
        from ._resolve import runnable_here

        backends = self.backends()
        detectable = self.detectable_backends()
        fallbacks = recorded_fallbacks()
        problems: dict[str, list[str]] = {}
        for provided in self.kernels():
            spec, plugin = provided.spec, provided.plugin
            found = []
            if spec.backend not in detectable:
                found.append((KernelProblem.UNDETECTABLE_BACKEND,
                              f"backend {spec.backend!r} is detected by no installed plugin (detectable: "
                              f"{', '.join(sorted(detectable))}), so this kernel is never chosen; install the "
                              "plugin that drives it, or fix the backend name"))
            elif (why := runnable_here(spec, backends)[2]):
                found.append((KernelProblem.CANNOT_RUN_HERE, why))
            cause = fallbacks.get((plugin.name, spec.id))
            if cause is not None:
                found.append((KernelProblem.FELL_BACK, f"passed over in this process: {cause}"))
            elif locate_impls and (missing := locate_problem(spec.impl)) is not None:
                found.append((KernelProblem.IMPL_MISSING,
                              f"impl {spec.impl!r}: {missing}; kernelize passes it over for the next kernel "
                              f"(reinstall or fix {plugin.distribution or plugin.name})"))
            if found:
                problems[spec.id] = found
        return problems

    def kind_problem(self, name: str) -> str | None:
        """Why layer kind ``name`` cannot be used (its matcher or adapter does not load), or None; warns once."""
        provided = self.layer_kinds()[name]
        for role in ("matcher", "adapter"):
            ref = getattr(provided.kind, role)
            problem = ref_problem(ref)
            if problem is not None:
                plugin = provided.plugin
                cause = f"its {role} {ref!r} {problem}"
                fix = ("Reinstall kernels-core" if plugin.name in RESERVED else
                       f"Fix the reference in the plugin's kernels_core_layer_kinds(), or block the plugin with "
                       f"{ENV_BLOCK}={plugin.name}")
                message = (f"layer kind {name!r} of plugin {plugin.name!r} ({plugin.origin}) is not used, so its "
                           f"modules keep their own forward: {cause}. {fix}")
                warn_fallback(plugin, f"kind:{name}", cause, message)
                return message
        return None

    def note_fallback(self, provided: ProvidedKernel, cause: str) -> None:
        """Record and warn (once per kernel and cause, per process) that an automatic choice passed a kernel over."""
        spec, plugin = provided.spec, provided.plugin
        fix = f"reinstall or fix {plugin.distribution}" if plugin.distribution else f"fix plugin {plugin.name!r}"
        warn_fallback(plugin, spec.id, cause,
                      f"kernel {spec.id!r} of plugin {plugin.name!r} ({plugin.origin}) cannot be used, so the next "
                      f"candidate runs instead: {cause}. To fix it, {fix}; to stop trying it, set "
                      f'kernels.disable = ["{spec.id}"] in kernels.toml')

    def default_binding(self, *, forward: object, **_context: object) -> Binding:
        """The binding of a kernel whose plugin's ``kernels_core_bind_kernel`` has no opinion: the module's forward."""
        return Binding({"forward": forward})

    def bind_hook_of(self, plugin_name: str) -> Callable[..., object] | None:
        """``kernels_core_bind_kernel`` as pluggy calls it on plugin ``plugin_name``'s implementations alone
        (``firstresult``, its wrappers included), or None where that plugin implements none."""
        plugin = self._pm.get_plugin(plugin_name)
        hook = self._pm.hook.kernels_core_bind_kernel
        if plugin is None or not any(impl.plugin is plugin for impl in hook.get_hookimpls()):
            return None
        others = [other for _name, other in self._pm.list_name_plugin() if other is not plugin]
        return self._pm.subset_hook_caller("kernels_core_bind_kernel", remove_plugins=others)


def _attribute_problems(plugin: object) -> list[str]:
    """Module attributes named like kernels-core's but unknown to it (a misspelt ``KERNELS_CORE_PLUGIN_API`` would
    otherwise leave the plugin on the default API version without a word)."""
    known = (API_ATTRIBUTE,)
    problems = []
    for attr in dir(plugin):
        if attr.startswith("KERNELS_CORE_") and attr not in known:
            problems.append(f"unknown attribute {attr!r}{did_you_mean(attr, known)}, which kernels-core ignores; the "
                            f"attributes it reads: {', '.join(known)}")
    return problems


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
