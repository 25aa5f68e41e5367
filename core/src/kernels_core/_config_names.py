"""Checking the names in a configuration against what is installed.

:mod:`kernels_core._config` checks shapes and types; this module checks that every name means something here:
layer kinds, kernel ids, plugin names, backend keys of ``prefer`` and option names. One configuration is often
shared between machines with different plugins, so a name that matches nothing installed warns
(:class:`~kernels_core.ConfigWarning`) with the closest installed names and its source, unknown layer kinds
included, whatever ``strict`` says (``strict`` is about kernels, not names); a warnings filter makes them errors.
Option names a known kind does not declare, option values of the wrong type, and a ``prefer`` list for a backend
installed here that names no installed kernel of its kind (kernelize could not honour it) always raise.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ._config import KernelsConfig
from ._errors import ConfigError
from ._errors import ConfigWarning
from ._hints import user_stacklevel
from ._plugins._loading import ENV_ALLOW
from ._plugins._loading import ENV_BLOCK
from ._plugins._manager import KernelsPluginManager
from ._plugins._records import PluginStatus
from ._types import ANY_BACKEND


__all__ = ["ConfigProblem", "check_config", "config_problems"]

_PACKAGE_DIR = str(Path(__file__).parent) + os.sep
_RELAX = "ignored (an error under warnings.filterwarnings('error', category=kernels_core.ConfigWarning))"


@dataclass(frozen=True)
class ConfigProblem:
    """One name in the configuration that does not fit what is installed.

    Args:
        source: where the name was set: a file path, an environment variable or ``config argument``.
        key: the dotted key that holds it (``kinds.rms_norm.disable``); empty for an environment variable.
        message: what is wrong and the closest valid names.
        error: always raises (undeclared option, wrong option type, a preference that cannot be honoured);
            otherwise it warns.
    """

    source: str
    key: str
    message: str
    error: bool = False

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}" if self.key else f"{self.source}: {self.message}"


def _did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    scored = []
    for candidate in sorted(set(candidates)):
        matcher = difflib.SequenceMatcher(None, name, candidate)
        if matcher.real_quick_ratio() >= 0.6 and matcher.quick_ratio() >= 0.6 and matcher.ratio() >= 0.6:
            scored.append((matcher.ratio(), candidate))
    if not scored:
        return None
    best = max(score for score, _candidate in scored)
    # Offer the runners-up only when they are nearly as close; one clear fix reads better than three guesses.
    close = [c for score, c in sorted(scored, key=lambda sc: (-sc[0], sc[1])) if score >= best - 0.05][:3]
    return f"did you mean {' or '.join(repr(c) for c in close)}?"


def _closest(name: str, candidates: Iterable[str], what: str) -> str:
    pool = sorted(set(candidates))
    close = _did_you_mean(name, pool)
    if close:
        return close
    if not pool:
        return f"no {what} is installed"
    if len(pool) <= 12:
        return f"installed {what}: {pool}"
    return f"none is close among the {len(pool)} installed {what}"


@dataclass
class _Installed:
    plugins: frozenset[str]
    not_loaded: tuple[str, ...]
    kernels: dict[str, tuple[str, str]]  # id -> (kind, backend)
    kinds: dict[str, object]  # name -> LayerKind
    backends: frozenset[str]

    @classmethod
    def of(cls, pm: KernelsPluginManager) -> _Installed:
        plugins = pm.plugins
        kernels = {p.spec.id: (p.spec.kind, p.spec.backend) for p in pm.kernels()}
        backends = {b.backend for b, _plugin in pm.backends()} | {backend for _kind, backend in kernels.values()}
        return cls(
            plugins=frozenset(p.name for p in plugins),
            not_loaded=tuple(sorted(p.name for p in plugins if p.status != PluginStatus.LOADED)),
            kernels=kernels,
            kinds={name: provided.kind for name, provided in pm.layer_kinds().items()},
            backends=frozenset(backends | {ANY_BACKEND}),
        )

    def ids_of_kind(self, kind: str) -> list[str]:
        return [kernel_id for kernel_id, (k, _backend) in self.kernels.items() if k == kind]


class _Collector:
    def __init__(self, config: KernelsConfig, installed: _Installed) -> None:
        self.config = config
        self.installed = installed
        self.problems: list[ConfigProblem] = []

    def add(self, path: tuple[str, ...], message: str, *, error: bool = False, source: str | None = None) -> None:
        self.problems.append(ConfigProblem(source or self.config.origin(*path), ".".join(path), message, error))

    def add_env(self, source: str, message: str) -> None:
        self.problems.append(ConfigProblem(source, "", message))

    def unknown_kernel(self, path: tuple[str, ...], kernel_id: str, kind: str | None, *, plugins_too: bool = False,
                       error: bool = False, why: str = "") -> None:
        installed = self.installed
        pool = installed.ids_of_kind(kind) if kind else list(installed.kernels)
        what = f"kernel ids of kind {kind}" if kind else "kernel ids"
        if plugins_too:
            pool += list(installed.plugins)
            what += " or plugin names"
        message = f"{kernel_id!r} matches no installed kernel"
        message += " or plugin" if plugins_too else ""
        message += f"; {_closest(kernel_id, pool, what)}"
        if installed.not_loaded:
            message += f" (plugins {list(installed.not_loaded)} did not load, so their kernels are not known)"
        self.add(path, message + why, error=error)

    def plugin_names(self, names: Iterable[str], path: tuple[str, ...] = (), *, source: str | None = None
                     ) -> None:
        for name in sorted(names):
            if name not in self.installed.plugins:
                message = f"{name!r} is not an installed plugin; {_closest(name, self.installed.plugins, 'plugins')}"
                if source is None:
                    self.add(path, message)
                else:
                    self.add_env(source, message)

    def preference(self, kind_name: str, backend: str, listed: tuple[str, ...]) -> None:
        """The problems of ``kinds.<kind_name>.prefer.<backend>``."""
        installed = self.installed
        path = ("kinds", kind_name, "prefer", backend)
        if backend not in installed.backends:
            self.add(path, f"backend {backend!r} is not declared by any installed plugin; "
                           f"{_closest(backend, installed.backends, 'backends')}")
        # Where this machine has the backend and not one listed id is a kernel of the kind, kernelize cannot
        # honour the preference, so the names are an error here, not "ignored": the message names the ids, the
        # closest installed ones and the source. An id among installed ones is skipped, and only warns.
        unusable = backend in installed.backends and not any(
            installed.kernels.get(kernel_id, ("",))[0] == kind_name for kernel_id in listed)
        why = (f"; none of kinds.{kind_name}.prefer.{backend} is an installed kernel of kind {kind_name}, so "
               "kernelize cannot honour it") if unusable else ""
        for kernel_id in listed:
            if kernel_id not in installed.kernels:
                self.unknown_kernel(path, kernel_id, kind_name, error=unusable, why=why)
                continue
            kind, runs_on = installed.kernels[kernel_id]
            if kind != kind_name:
                self.add(path, f"kernel {kernel_id!r} implements kind {kind!r}, never {kind_name!r}; "
                               f"{_closest(kernel_id, installed.ids_of_kind(kind_name), 'kernel ids')}{why}",
                         error=unusable)
            elif backend != ANY_BACKEND and runs_on not in (ANY_BACKEND, backend):
                self.add(path, f"kernel {kernel_id!r} runs on backend {runs_on!r}, so modules on {backend!r} "
                               "can never use it")

    def options(self, kind_name: str, options: Mapping[str, object],
                declared: Mapping[str, type | tuple[type, ...]]) -> None:
        """The problems of ``kinds.<kind_name>.options``, against the options the kind declares."""
        for option, value in sorted(options.items()):
            path = ("kinds", kind_name, "options", option)
            if option not in declared:
                allowed = sorted(declared)
                hint = _closest(option, allowed, "options") if allowed else f"kind {kind_name!r} takes no options"
                self.add(path, f"unknown option {option!r} for kind {kind_name!r}; {hint}; allowed: {allowed}",
                         error=True)
                continue
            expected = declared[option]
            types = expected if isinstance(expected, tuple) else (expected,)
            if not _fits(value, types):
                names = " or ".join(t.__name__ for t in types)
                self.add(path, f"option {option!r} of kind {kind_name!r} expects {names}, got "
                               f"{type(value).__name__} {value!r}", error=True)


def config_problems(config: KernelsConfig, pm: KernelsPluginManager) -> list[ConfigProblem]:
    """Every name in ``config`` (and in the manager's allow/block lists) that does not fit what ``pm`` has.

    Example:
        >>> from kernels_core.testing import fresh_plugin_manager
        >>> cfg = KernelsConfig.from_mapping({"kernels": {"disable": ["any.rms_norm.recompte"]}})
        >>> print(config_problems(cfg, fresh_plugin_manager())[0])  # doctest: +ELLIPSIS
        config argument: kernels.disable: 'any.rms_norm.recompte' matches no installed kernel; did you mean ...
    """
    installed = _Installed.of(pm)
    out = _Collector(config, installed)
    if config.allow_plugins is not None:
        out.plugin_names(config.allow_plugins, ("plugins", "allow"))
    out.plugin_names(config.block_plugins, ("plugins", "block"))
    # The manager's own lists come from the environment (or its constructor); a typo there loads everything.
    for names, variable, argument in ((pm.allow or (), ENV_ALLOW, "allow"), (pm.block, ENV_BLOCK, "block")):
        raw = os.environ.get(variable, "").strip()
        source = f"{variable}={raw}" if raw else f"KernelsPluginManager({argument}=...)"
        out.plugin_names(names, source=source)
    for kernel_id in sorted(config.disabled_kernels):
        if kernel_id not in installed.kernels:
            out.unknown_kernel(("kernels", "disable"), kernel_id, None)
    for kind_name in sorted(config.kinds):
        kind_config = config.kinds[kind_name]
        if kind_name not in installed.kinds:
            # A kind another machine's plugin provides (npu's attention on a CUDA host) is not a typo there.
            close = _did_you_mean(kind_name, installed.kinds)
            message = (f"unknown layer kind {kind_name!r}{'; ' + close if close else ''}; "
                       f"installed kinds: {sorted(installed.kinds)}")
            if installed.not_loaded:
                message += f" (plugins {list(installed.not_loaded)} did not load, so their kinds are not known)"
            out.add(("kinds", kind_name), message)
            continue
        for name in sorted(kind_config.disable):
            path = ("kinds", kind_name, "disable")
            if name in installed.kernels:
                other = installed.kernels[name][0]
                if other != kind_name:
                    out.add(path, f"kernel {name!r} implements kind {other!r}, never {kind_name!r}")
            elif name not in installed.plugins:
                out.unknown_kernel(path, name, kind_name, plugins_too=True)
        for backend in sorted(kind_config.prefer):
            out.preference(kind_name, backend, kind_config.prefer[backend])
        declared = getattr(installed.kinds[kind_name], "options", None)
        if declared is not None:
            out.options(kind_name, kind_config.options, declared)
    return out.problems


def _fits(value: object, types: tuple[type, ...]) -> bool:
    # TOML and JSON have no int/bool distinction problems, but Python does: True is an int; 3 is a fine float.
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def check_config(config: KernelsConfig, pm: KernelsPluginManager) -> list[ConfigProblem]:
    """Raise or warn for every problem :func:`config_problems` finds; returns the ones that only warned.

    Problems marked ``error`` raise one :class:`ConfigError` listing all of them. Every other problem is one
    :class:`ConfigWarning`, attributed to the first caller outside kernels-core, so Python's default filter shows it
    once per call site.

    Example:
        >>> from kernels_core.testing import fresh_plugin_manager
        >>> check_config(KernelsConfig.from_mapping({"kinds": {"rms_norm": {"options": {"x": 1}}}}),
        ...              fresh_plugin_manager())
        Traceback (most recent call last):
        ...
        kernels_core.ConfigError: config argument: kinds.rms_norm.options.x: unknown option 'x' for kind ...
    """
    problems = list(dict.fromkeys(config_problems(config, pm)))
    fatal = [p for p in problems if p.error]
    if fatal:
        raise ConfigError(str(fatal[0]) if len(fatal) == 1 else (
            f"{len(fatal)} configuration problems:\n  " + "\n  ".join(str(p) for p in fatal)))
    level = user_stacklevel()
    for problem in problems:
        warnings.warn(f"{problem}; {_RELAX}", ConfigWarning, stacklevel=level)
    return problems
