"""Loading plugins: which ones a process uses, and collecting what they declare through pluggy's hooks.

pluggy's own ``load_setuptools_entrypoints`` imports every plugin with no error isolation, so :class:`PluginLoader`
loads each entry point itself, under the environment's allow and block lists; hooks are called through pluggy
(:attr:`PluginLoader.hooks`) with each implementation isolated (:mod:`._isolation`). A plugin that fails to import,
states an incompatible plugin API version, raises in a hook or declares malformed data is skipped as a whole, with
one warning naming it, its distribution and version, and every other plugin keeps working.

The names ``builtin`` and ``portable`` belong to the kernels-core distribution: another distribution advertising
them is refused before its module is imported, so it can neither replace the core's layer kinds nor run code.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from importlib import metadata as importlib_metadata
from types import ModuleType

import pluggy

from .._config import env_flag
from .._errors import PluginError
from .._hints import did_you_mean
from .._types import BackendInfo
from .._types import KernelSpec
from .._types import LayerKind
from ._cross_check import cross_check
from ._declarations import Declarations
from ._hookspec import API_ATTRIBUTE
from ._hookspec import PLUGIN_API_VERSION
from ._hookspec import PROJECT_NAME
from ._hookspec import Hooks
from ._isolation import IsolatingPluginManager
from ._records import Contribution
from ._records import PluginInfo
from ._records import PluginStatus
from ._records import canonical_distribution
from ._records import replace_info


__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_ALLOW",
    "ENV_BLOCK",
    "ENV_STRICT",
    "ENV_TRACE",
    "RESERVED",
    "PluginLoader",
    "api_problem",
]

# One logger for the package: what a user configures is `kernels_core`, never a private module.
logger = logging.getLogger("kernels_core")

ENTRY_POINT_GROUP = "kernels_core.plugins"
ENV_ALLOW = "KERNELS_CORE_PLUGINS"
ENV_BLOCK = "KERNELS_CORE_DISABLE_PLUGINS"
ENV_STRICT = "KERNELS_CORE_STRICT_PLUGINS"
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
    when kernelize checks its configuration (``kernels_core._config_names``)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


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


class PluginLoader:
    """Which plugins one manager uses, each with its status, and what the loaded ones declare.

    ``strict`` raises :class:`~kernels_core.PluginError` instead of skipping a broken plugin; ``allow`` (only these
    names load, plus ``builtin``) and ``block`` (these do not) come from the environment unless given.
    """

    def __init__(self, *, strict: bool | None = None, allow: Iterable[str] | None = None,
                 block: Iterable[str] | None = None) -> None:
        self.strict = bool(env_flag(ENV_STRICT)) if strict is None else strict
        self.allow = frozenset(allow) if allow is not None else _env_list(ENV_ALLOW)
        self.block = frozenset(block) if block is not None else (_env_list(ENV_BLOCK) or frozenset())
        # pluggy's manager: registration, and every hook call.
        self.hooks = IsolatingPluginManager(PROJECT_NAME, {hook: kind for hook, (kind, _) in DECLARATIONS.items()})
        self.hooks.add_hookspecs(Hooks)
        if env_flag(ENV_TRACE):
            self.hooks.trace.root.setwriter(lambda line: logger.info("pluggy: %s", line.rstrip()))
            self.hooks.enable_tracing()
        self.infos: dict[str, PluginInfo] = {}
        # Refused entry points (reserved or duplicate names): listed, never imported, never registered.
        self.refused: list[PluginInfo] = []
        # Name clashes found while loading survive invalidate(); those found while collecting are recomputed.
        self.conflicts: list[str] = []
        self._lock = threading.RLock()
        self._declared: Declarations | None = None
        self._warned: set[str] = set()

    # -- which plugins are in ------------------------------------------------------------------------------

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
            if ep.name in self.infos:
                self._refuse(info, f"the plugin name {ep.name!r} is already taken by {self.infos[ep.name].origin}; "
                                   f"{ep.value!r} was not imported. Rename one of the two entry points, or "
                                   "uninstall one distribution")
                continue
            skip_reason = self._blocked_reason(ep.name)
            if skip_reason:
                self.infos[ep.name] = replace_info(info, status=PluginStatus.BLOCKED, reason=skip_reason)
                logger.debug("plugin %r not loaded: %s", ep.name, skip_reason)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must be isolated
                self._fail(info, f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}", exc)
                continue
            self._register(plugin, info)
        if "builtin" not in self.infos:
            # kernels-core's own entry points are missing (a source tree on sys.path, not installed): its layer
            # kinds are still needed, and no other distribution may stand in for them.
            from .. import _builtin

            logger.debug("no kernels-core entry point named builtin; registering %s directly", RESERVED["builtin"])
            self._register(_builtin, PluginInfo(name="builtin", module=RESERVED["builtin"]))

    def register(self, plugin: ModuleType | object, name: str, *, distribution: str | None = None,
                 version: str | None = None) -> PluginInfo:
        """Register an in-process plugin object or module (tests, notebooks, frameworks embedding kernels)."""
        module_name = getattr(plugin, "__name__", type(plugin).__name__)
        if name in RESERVED and module_name != RESERVED[name]:
            raise ValueError(f"the plugin name {name!r} is reserved for kernels-core's own {RESERVED[name]}; "
                             f"register {module_name!r} under another name")
        info = PluginInfo(name=name, module=module_name, distribution=distribution, version=version)
        if name in self.infos and self.infos[name].status == PluginStatus.LOADED:
            raise ValueError(f"a plugin named {name!r} is already registered ({self.infos[name].origin})")
        skip_reason = self._blocked_reason(name)
        if skip_reason:
            info = replace_info(info, status=PluginStatus.BLOCKED, reason=skip_reason)
            self.infos[name] = info
            return info
        self._register(plugin, info)
        return self.infos[name]

    def unregister(self, name: str) -> None:
        plugin = self.hooks.get_plugin(name)
        if plugin is not None:
            self.hooks.unregister(plugin)
        self.infos.pop(name, None)
        self.invalidate()

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
            self.infos[info.name] = replace_info(info, status=PluginStatus.REFUSED, reason=problem)
            message = f"kernels-core plugin {info.name!r} ({info.origin}) refused: {problem}"
            if self.strict:
                raise PluginError(info.name, message)
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
            return
        try:
            self.hooks.register(plugin, name=info.name)
            self._check_pending(info.name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors, bad hook signatures
            if self.hooks.get_plugin(info.name) is not None:
                self.hooks.unregister(name=info.name)
            self._fail(info, f"invalid hook implementation: {exc}", exc)
            return
        self.infos[info.name] = info
        self.invalidate()

    def _check_pending(self, name: str) -> None:
        # pluggy's check_pending() covers every plugin; doing it per registration names the culprit.
        known = {spec for spec in dir(Hooks) if spec.startswith("kernels_core_")}
        plugin = self.hooks.get_plugin(name)
        for attr in dir(plugin):
            if not attr.startswith("kernels_core_") or attr in known:
                continue
            if self.hooks.parse_hookimpl_opts(plugin, attr) is not None:
                raise pluggy.PluginValidationError(
                    plugin,
                    f"unknown hook {attr!r} (misspelled?); known hooks: {', '.join(sorted(known))}",
                )
        self.hooks.check_pending()
        for caller in self.hooks.get_hookcallers(plugin) or ():
            if any(impl.plugin is plugin and impl.hookwrapper for impl in caller.get_hookimpls()):
                raise pluggy.PluginValidationError(
                    plugin, f"{caller.name} is an old-style hookwrapper=True wrapper; kernels-core takes new-style "
                            "wrappers only: @hookimpl(wrapper=True), returning the (edited) result")

    def _refuse(self, info: PluginInfo, reason: str) -> None:
        refused = replace_info(info, status=PluginStatus.REFUSED, reason=reason)
        self.refused.append(refused)
        message = f"kernels-core plugin {info.name!r} ({info.origin}) refused: {reason}"
        self.conflicts.append(message)
        if self.strict:
            raise PluginError(info.name, message)
        logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    def _fail(self, info: PluginInfo, reason: str, exc: BaseException | None = None) -> None:
        self.infos[info.name] = replace_info(info, status=PluginStatus.FAILED, reason=reason)
        message = f"kernels-core plugin {info.name!r} ({info.origin}) skipped: {reason}"
        logger.debug("%s", message, exc_info=exc)
        if self.strict:
            raise PluginError(info.name, message) from exc
        logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    # -- what they declare ---------------------------------------------------------------------------------

    def declarations(self) -> Declarations:
        """What the loaded plugins declare, collected once (until :meth:`invalidate`)."""
        with self._lock:
            if self._declared is None:
                self._declared = self._collect()
            return self._declared

    def invalidate(self) -> None:
        """Forget collected declarations so the next query asks the plugins again."""
        with self._lock:
            self._declared = None
            for name, info in list(self.infos.items()):
                if info.status == PluginStatus.SKIPPED or (info.status == PluginStatus.LOADED and info.reason):
                    self.infos[name] = replace_info(info, status=PluginStatus.LOADED, reason=None)

    def _collect(self) -> Declarations:
        found = Declarations(self.infos)
        contributions = {name: Contribution() for name, i in sorted(self.infos.items())
                         if i.status == PluginStatus.LOADED}
        failed: dict[str, tuple[str, BaseException | None]] = {}
        for hook, (_type, slot) in DECLARATIONS.items():
            declared, faults = self.hooks.declare(hook)
            for fault in faults:
                if fault.soft:
                    self._soft_problem(found, fault.plugin, fault.problem)
                else:
                    failed.setdefault(fault.plugin, (fault.problem, fault.error))
            for plugin, value in declared:
                if plugin in contributions:
                    getattr(contributions[plugin], slot).append(value)
        for name in sorted(contributions):
            for problem in _attribute_problems(self.hooks.get_plugin(name)):
                self._soft_problem(found, name, problem)
        for name in sorted(failed):
            contributions.pop(name, None)
            self._skip(found, name, *failed[name])
        checked = cross_check(contributions)
        for skip in checked.skipped:
            self._skip(found, skip.plugin, skip.reason, clash=skip.clash)
        for conflict in checked.conflicts:
            self._note_conflict(found, conflict)
        for name, spec, reason in checked.rejected:
            # One kernel of a loaded plugin dropped (its others stay): listed, warned once, raised if strict.
            found.rejected.append((spec, self.infos[name], reason))
            self._soft_problem(found, name, f"kernel {spec.id!r} ignored: {reason}")
        for name, problems in found.soft_problems.items():
            if self.infos[name].status == PluginStatus.LOADED:
                self.infos[name] = replace_info(self.infos[name], reason="; ".join(problems))
        found.contributions = checked.kept
        return found

    def _note_conflict(self, found: Declarations, message: str) -> None:
        found.conflicts.append(message)
        logger.warning("kernels-core plugin conflict: %s", message)

    def _soft_problem(self, found: Declarations, name: str, problem: str) -> None:
        """A problem that does not stop a loaded plugin: warned once, shown as its reason, raised if strict."""
        found.soft_problems.setdefault(name, []).append(problem)
        message = f"kernels-core plugin {name!r} ({self.infos[name].origin}): {problem}"
        if self.strict:
            raise PluginError(name, message)
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)

    def _skip(self, found: Declarations, name: str, reason: str, error: BaseException | None = None, *,
              clash: bool = False) -> None:
        """Skip a loaded plugin whole for this collection: warned (as a conflict for a clash), raised if strict."""
        self.infos[name] = replace_info(self.infos[name], status=PluginStatus.SKIPPED, reason=reason)
        message = f"kernels-core plugin {name!r} ({self.infos[name].origin}) skipped: {reason}"
        if error is not None:
            logger.debug("%s", message, exc_info=error)
        if clash:
            self._note_conflict(found, message)
        if self.strict:
            raise PluginError(name, message) from error
        if not clash:
            logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
