"""What went wrong with plugins, said so that their users can act: kernels that will not (or may not) be used
(``kernels-core kernels``, ``kernels-core check``), among them those that cannot run on this machine at all
(:func:`runnable_here`), layer kinds whose code does not load, and the broken plugin code one kernelize call met
(:class:`PluginFaults`).

Each is warned about with a :class:`~kernels_core.KernelFallbackWarning` naming the plugin, its distribution, the
kernel or kind and the cause, once per process and cause (:mod:`._fallbacks`); strict kernelize raises for broken
plugin code instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from importlib import metadata as importlib_metadata
from typing import Any

from .._refs import locate_problem
from .._refs import ref_problem
from .._types import BackendInfo
from .._types import DeviceInfo
from .._types import device_name
from ._declarations import Declarations
from ._fallbacks import recorded_fallbacks
from ._fallbacks import warn_fallback
from ._loading import ENV_BLOCK
from ._loading import RESERVED
from ._records import Fault
from ._records import KernelProblem
from ._records import PluginInfo
from ._records import ProvidedKernel
from ._records import ProvidedKind


__all__ = ["PluginFaults", "kernel_problems", "kind_problem", "requirement_problem", "runnable_here", "where"]

logger = logging.getLogger("kernels_core")


def kernel_problems(declared: Declarations, *, locate_impls: bool = True) -> dict[str, list[tuple[str, str]]]:
    """Why listed kernels will not (or may not) be used: kernel id -> ``(status, detail)`` pairs.

    Statuses: ``undetectable backend`` (no installed plugin detects the kernel's backend, so it is never
    chosen), ``cannot run here`` (no device of its backend is present, or a capability, architecture or
    requirement is not met: what ``kernels-core check`` skips it for), ``fell back`` (recorded in this process)
    and, with ``locate_impls``, ``impl missing`` (the ``impl`` module cannot be found). Imports nothing new.
    """
    backends = declared.backends()
    detectable = declared.detectable_backends()
    fallbacks = recorded_fallbacks()
    problems: dict[str, list[tuple[str, str]]] = {}
    for provided in declared.kernels():
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


@cache
def requirement_problem(requirement: str) -> str | None:
    """Why this machine does not meet a kernel's ``requires`` entry (a PEP 508 requirement), or None."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate():
        return None
    try:
        installed = importlib_metadata.version(req.name)
    except importlib_metadata.PackageNotFoundError:
        return f"requirement missing: {req.name} is not installed (needs {requirement})"
    if req.specifier and not req.specifier.contains(installed, prereleases=True):
        return f"requirement missing: {req.name} {installed} installed, needs {requirement}"
    return None


def runnable_here(spec: Any, backends: list[tuple[BackendInfo, Any]]
                  ) -> tuple[str | None, DeviceInfo | None, str]:
    """(device name, its info, why there is none) for a kernel: the device it can run on here, the first detected
    one of its backend (the host CPU for portable kernels), or why it cannot run on this machine: no device of its
    backend, a capability or architecture it does not support, a requirement missing.

    ``kernels-core kernels`` and ``kernels-core check`` both decide with it. Imports no kernel code.

    Example:
        >>> from kernels_core import KernelSpec
        >>> from kernels_core.testing import fresh_plugin_manager
        >>> spec = KernelSpec(id="acme.rms_norm.k", kind="rms_norm", variants=("standard",), backend="acme",
        ...                   impl="kernels_acme.ops:rms_norm")
        >>> runnable_here(spec, fresh_plugin_manager().backends())
        (None, None, 'no acme device detected')
    """
    backend = "cpu" if spec.portable else spec.backend
    detected = [b for b, _ in backends if b.backend == backend]
    with_devices = [b for b in detected if b.devices]
    if not with_devices:
        reasons = "; ".join(b.reason for b in detected if b.reason)
        return None, None, f"no {backend} device detected" + (f" ({reasons})" if reasons else "")
    info = with_devices[0]
    device = info.devices[0]
    name = device_name(info.device_type, device.index)
    if spec.capability is not None and not spec.portable:
        if device.capability is None or not spec.capability.contains(device.capability):
            return None, None, f"{name} has capability {device.capability}, the kernel needs {spec.capability}"
    if spec.archs and not spec.portable and device.arch not in spec.archs:
        return None, None, f"{name} is {device.arch}, the kernel needs one of {list(spec.archs)}"
    for requirement in spec.requires:
        problem = requirement_problem(requirement)
        if problem:
            return None, None, problem
    return name, device, ""


def kind_problem(provided: ProvidedKind) -> str | None:
    """Why a layer kind cannot be used (its matcher or adapter does not load), or None; warns once."""
    for role in ("matcher", "adapter"):
        ref = getattr(provided.kind, role)
        problem = ref_problem(ref)
        if problem is not None:
            plugin, name = provided.plugin, provided.kind.name
            cause = f"its {role} {ref!r} {problem}"
            fix = ("Reinstall kernels-core" if plugin.name in RESERVED else
                   f"Fix the reference in the plugin's kernels_core_layer_kinds(), or block the plugin with "
                   f"{ENV_BLOCK}={plugin.name}")
            message = (f"layer kind {name!r} of plugin {plugin.name!r} ({plugin.origin}) is not used, so its "
                       f"modules keep their own forward: {cause}. {fix}")
            warn_fallback(plugin, f"kind:{name}", cause, message)
            return message
    return None


def where(name: str, module: object) -> str:
    """How a message names a module: its qualified name in the model, and its class."""
    return f"{name or '(model)'!r} ({type(module).__qualname__})"


def _kind_fix(provided: ProvidedKind) -> str:
    name, plugin = provided.kind.name, provided.plugin.name
    if plugin in RESERVED:
        return f"to run without the kind, set [kinds.{name}] enabled = false (and report this to kernels-core)"
    return (f"fix the plugin's code; to run without it, set [kinds.{name}] enabled = false or block the plugin with "
            f"{ENV_BLOCK}={plugin}")


class PluginFaults:
    """Broken plugin code met by one kernelize call: one :class:`Fault` per plugin, subject (kernel or kind) and
    role, with every module it concerns (``where``: a module's name and class).

    Example:
        >>> PluginFaults().strict_problems(lambda kind: True)
        []
    """

    def __init__(self) -> None:
        # (plugin, subject, role) -> the fault, its plugin, how to say it about some modules, the modules.
        self._found: dict[tuple[str, str, str], tuple[Fault, PluginInfo, Callable[[str], str], list[str]]] = {}

    def _add(self, role: str, plugin: PluginInfo, subject: str, kind: str, cause: str, where: str,
             describe: Callable[[str], str], error: BaseException | None = None) -> None:
        fault = Fault(plugin.name, cause, error, subject=subject, kind=kind)
        _fault, _plugin, _describe, modules = self._found.setdefault((plugin.name, subject, role),
                                                                     (fault, plugin, describe, []))
        if error is not None and not modules:
            # The traceback, for whoever turns on kernels_core's DEBUG log; warnings carry the message alone.
            logger.debug("plugin %r: %s of %s raised on %s", plugin.name, role, subject, where, exc_info=error)
        modules.append(where)

    def matcher_raised(self, provided: ProvidedKind, where: str, cause: str, error: BaseException | None = None
                       ) -> None:
        kind, plugin = provided.kind, provided.plugin

        def describe(modules: str) -> str:
            return (f"layer kind {kind.name!r} of plugin {plugin.name!r} ({plugin.origin}): its matcher "
                    f"{kind.matcher} raised {cause} on {modules}, which keep their own forward; {_kind_fix(provided)}")

        self._add("matcher", plugin, f"kind:{kind.name}", kind.name, cause, where, describe, error)

    def adapter_raised(self, provided: ProvidedKind, kernel: ProvidedKernel, where: str, cause: str,
                       error: BaseException | None = None) -> None:
        kind, plugin = provided.kind, provided.plugin

        def describe(modules: str) -> str:
            return (f"layer kind {kind.name!r} of plugin {plugin.name!r} ({plugin.origin}): its adapter "
                    f"{kind.adapter} raised {cause} building kernel {kernel.spec.id!r} (plugin "
                    f"{kernel.plugin.name!r}) for {modules}, so the next candidate kernel runs there, or the "
                    f"module's own forward; {_kind_fix(provided)}")

        self._add("adapter", plugin, f"kind:{kind.name}", kind.name, cause, where, describe, error)

    def output_wrong(self, kernel: ProvidedKernel, where: str, cause: str) -> None:
        spec, plugin = kernel.spec, kernel.plugin
        fix = f"reinstall or fix {plugin.distribution}" if plugin.distribution else f"fix plugin {plugin.name!r}"

        def describe(modules: str) -> str:
            return (f"kernel {spec.id!r} of plugin {plugin.name!r} ({plugin.origin}) is not used for {modules}, so "
                    f"the next candidate runs there, or the module's own forward: {cause}. To fix it, {fix} (check "
                    f"it with `kernels-core check {plugin.name} --kernel {spec.id}`); to stop trying it, set "
                    f'kernels.disable = ["{spec.id}"] in kernels.toml')

        self._add("output", plugin, spec.id, spec.kind, cause, where, describe)

    def messages(self) -> list[tuple[Fault, str]]:
        return [(fault, _said(describe, modules)) for fault, _plugin, describe, modules in self._found.values()]

    def warn(self) -> None:
        """One ``KernelFallbackWarning`` per fault (and once per process and cause)."""
        for fault, plugin, describe, modules in self._found.values():
            warn_fallback(plugin, fault.subject, fault.problem, _said(describe, modules))

    def strict_problems(self, strict_for: Callable[[str], bool]) -> list[str]:
        """The faults of kinds that kernelize is strict about."""
        return [message for fault, message in self.messages() if strict_for(fault.kind)]

    def first_error(self, strict_for: Callable[[str], bool]) -> BaseException | None:
        """The exception of the first fault kernelize is strict about: the ``__cause__`` of its error."""
        return next((fault.error for fault, *_ in self._found.values()
                     if fault.error is not None and strict_for(fault.kind)), None)


def _said(describe: Callable[[str], str], modules: list[str]) -> str:
    more = f" and {len(modules) - 1} other module(s)" if len(modules) > 1 else ""
    return describe(f"module {modules[0]}{more}")
