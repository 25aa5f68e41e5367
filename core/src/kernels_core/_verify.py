"""What kernelize checks before it binds a kernel, and the broken plugin code those checks (and matchers) reveal.

For each module a kernel is about to serve, the kind's adapter builds what the module would run (its new forward,
or the replacement for the global function its forward calls). Where the kind's matcher probed the module
(:meth:`MatchContext.note_probe`: RMSNorm, LayerNorm, gated MLPs, decoder layers, MoE experts, rotary embeddings),
that callable then runs on the probe's inputs and must return what the module's own forward returned there: the
same structure, and tensors of the same shape, dtype and device. Values are not compared (the probe weights may
differ from the module's, and ``kernels-core check`` compares values against the eager module).

The kernel really runs, on the probe's few rows, where that is cheap and safe: for modules on the CPU, and for
portable kernels (backend ``any``, plain PyTorch by contract) on any device. A backend kernel on an accelerator is
left unchecked at kernelize: its first run there may JIT-compile it (for the probe's shapes, at kernelize) and wait
for the runtime set-up its plugin overlaps with the caller's work, and fake tensors are no way out (a kernel that
launches device code directly would get a null pointer from ``FakeTensor.data_ptr()``). ``kernels-core check``
checks those on their device. Modules whose parameters FSDP2 shards are left unchecked too (checking would gather
them again).

A check or adapter that fails makes kernelize pass the kernel over for that module, like an implementation that does
not import: the next candidate runs, or the module keeps its own forward. Each broken piece of plugin code (a
matcher or adapter that raises, a kernel whose output does not fit) is warned about once per kernelize call with a
:class:`~kernels_core.KernelFallbackWarning` naming the plugin, its distribution, the kernel or kind and the cause,
and once per process and cause; strict kernelize raises for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch
from torch import nn

from ._forward import tensors_in
from ._kinds._context import MatchContext
from ._kinds._context import Probe
from ._kinds._context import ProbeRandomness
from ._kinds._context import probe_behaviour
from ._kinds._zero3 import is_partitioned
from ._manager import ENV_BLOCK
from ._manager import RESERVED
from ._manager import ProvidedKernel
from ._manager import ProvidedKind
from ._plugin_info import PluginInfo
from ._plugin_info import warn_fallback
from ._refs import load_ref
from ._types import Match


__all__ = ["KernelChecks", "PluginFaults", "output_problem"]

logger = logging.getLogger("kernels_core")


def _where(name: str, module: nn.Module) -> str:
    return f"{name or '(model)'!r} ({type(module).__qualname__})"


@dataclass
class _Fault:
    plugin: PluginInfo
    subject: str
    kind: str
    cause: str
    describe: Callable[[str], str]
    modules: list[str] = field(default_factory=list)
    error: BaseException | None = None


class PluginFaults:
    """Broken plugin code met by one kernelize call, one entry per plugin, subject (kernel or kind) and role.

    Example:
        >>> PluginFaults().strict_problems(lambda kind: True)
        []
    """

    def __init__(self) -> None:
        self._faults: dict[tuple[str, str, str], _Fault] = {}

    def _add(self, role: str, plugin: PluginInfo, subject: str, kind: str, cause: str, where: str,
             describe: Callable[[str], str], error: BaseException | None = None) -> None:
        fault = self._faults.setdefault((plugin.name, subject, role),
                                        _Fault(plugin, subject, kind, cause, describe, error=error))
        if error is not None and not fault.modules:
            # The traceback, for whoever turns on kernels_core's DEBUG log; warnings carry the message alone.
            logger.debug("plugin %r: %s of %s raised on %s", plugin.name, role, subject, where, exc_info=error)
        fault.modules.append(where)

    def matcher_raised(self, provided: ProvidedKind, name: str, module: nn.Module, cause: str,
                       error: BaseException | None = None) -> None:
        kind, plugin = provided.kind, provided.plugin

        def describe(modules: str) -> str:
            return (f"layer kind {kind.name!r} of plugin {plugin.name!r} ({plugin.origin}): its matcher "
                    f"{kind.matcher} raised {cause} on {modules}, which keep their own forward; {_kind_fix(provided)}")

        self._add("matcher", plugin, f"kind:{kind.name}", kind.name, cause, _where(name, module), describe, error)

    def adapter_raised(self, provided: ProvidedKind, kernel: ProvidedKernel, name: str, module: nn.Module,
                       cause: str, error: BaseException | None = None) -> None:
        kind, plugin = provided.kind, provided.plugin

        def describe(modules: str) -> str:
            return (f"layer kind {kind.name!r} of plugin {plugin.name!r} ({plugin.origin}): its adapter "
                    f"{kind.adapter} raised {cause} building kernel {kernel.spec.id!r} (plugin "
                    f"{kernel.plugin.name!r}) for {modules}, so the next candidate kernel runs there, or the "
                    f"module's own forward; {_kind_fix(provided)}")

        self._add("adapter", plugin, f"kind:{kind.name}", kind.name, cause, _where(name, module), describe, error)

    def output_wrong(self, kernel: ProvidedKernel, name: str, module: nn.Module, cause: str) -> None:
        spec, plugin = kernel.spec, kernel.plugin
        fix = f"reinstall or fix {plugin.distribution}" if plugin.distribution else f"fix plugin {plugin.name!r}"

        def describe(modules: str) -> str:
            return (f"kernel {spec.id!r} of plugin {plugin.name!r} ({plugin.origin}) is not used for {modules}, so "
                    f"the next candidate runs there, or the module's own forward: {cause}. To fix it, {fix} (check "
                    f"it with `kernels-core check {plugin.name} --kernel {spec.id}`); to stop trying it, set "
                    f'kernels.disable = ["{spec.id}"] in kernels.toml')

        self._add("output", plugin, spec.id, spec.kind, cause, _where(name, module), describe)

    def messages(self) -> list[tuple[_Fault, str]]:
        out = []
        for fault in self._faults.values():
            modules = fault.modules
            more = f" and {len(modules) - 1} other module(s)" if len(modules) > 1 else ""
            out.append((fault, fault.describe(f"module {modules[0]}{more}")))
        return out

    def warn(self) -> None:
        """One ``KernelFallbackWarning`` per fault (and once per process and cause)."""
        for fault, message in self.messages():
            warn_fallback(fault.plugin, fault.subject, fault.cause, message)

    def strict_problems(self, strict_for: Callable[[str], bool]) -> list[str]:
        """The faults of kinds that kernelize is strict about."""
        return [message for fault, message in self.messages() if strict_for(fault.kind)]

    def first_error(self, strict_for: Callable[[str], bool]) -> BaseException | None:
        """The exception of the first fault kernelize is strict about: the ``__cause__`` of its error."""
        return next((f.error for f in self._faults.values() if f.error is not None and strict_for(f.kind)), None)



def _kind_fix(provided: ProvidedKind) -> str:
    name, plugin = provided.kind.name, provided.plugin.name
    if plugin in RESERVED:
        return f"to run without the kind, set [kinds.{name}] enabled = false (and report this to kernels-core)"
    return (f"fix the plugin's code; to run without it, set [kinds.{name}] enabled = false or block the plugin with "
            f"{ENV_BLOCK}={plugin}")


class KernelChecks:
    """The checks of one kernelize call: adapters build, outputs fit; results shared by modules of one probe."""

    def __init__(self, ctx: MatchContext, faults: PluginFaults) -> None:
        self.ctx = ctx
        self.faults = faults
        # (id(probe), kernel id) -> problem or None: layers sharing one probe (one piece of math) share the result.
        self._outputs: dict[tuple[int, str], str | None] = {}

    def build(self, module: nn.Module, name: str, kind: ProvidedKind, match: Match, kernel: ProvidedKernel,
              options: dict[str, object]) -> tuple[Any, str | None]:
        """(what the kind's adapter builds for this module and kernel, or None; why the kernel cannot serve it)."""
        try:
            built = load_ref(kind.kind.adapter)(module, match, load_ref(kernel.spec.impl), dict(options))
        except Exception as exc:  # noqa: BLE001 - a broken adapter declines, the other kinds and kernels go on
            cause = f"{type(exc).__name__}: {exc}"
            self.faults.adapter_raised(kind, kernel, name, module, cause, exc)
            return None, f"the adapter {kind.kind.adapter} of plugin {kind.plugin.name!r} raised {cause}"
        probe = self.ctx.probe_of(module, match)
        if probe is None:
            return built, None
        key = (id(probe), kernel.spec.id)
        if key not in self._outputs:
            self._outputs[key] = output_problem(module, built, probe, self.ctx, portable=kernel.spec.portable)
        problem = self._outputs[key]
        if problem is not None:
            self.faults.output_wrong(kernel, name, module, problem)
            return None, f"output check failed: {problem}"
        return built, None


def _mismatch(actual: Any, expected: Any, where: str) -> str | None:
    """How ``actual`` differs from ``expected`` in structure, shape, dtype or device, or None."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{where} is {type(actual).__name__}, where the module's own forward returns a tensor"
        for what, a, e in (("shape", tuple(actual.shape), tuple(expected.shape)),
                           ("dtype", actual.dtype, expected.dtype), ("device", actual.device, expected.device)):
            if a != e:
                return f"{where} has {what} {a}, where the module's own forward gives {e}"
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            size = f" of {len(actual)}" if isinstance(actual, (tuple, list)) else ""
            return (f"{where} is {type(actual).__name__}{size}, where the module's own forward returns "
                    f"{type(expected).__name__} of {len(expected)}")
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            problem = _mismatch(a, e, f"{where} {index}")
            if problem:
                return problem
    return None


def output_problem(module: nn.Module, built: Callable[..., Any], probe: Probe, ctx: MatchContext, *,
                   portable: bool) -> str | None:
    """Why ``built`` (a module's would-be forward or global replacement) does not fit ``probe``, or None.

    ``portable``: the kernel is plain PyTorch (backend ``any``), so it also runs off the CPU. None also where the
    check does not run (see the module docstring); the reason is logged at debug level.
    """
    on_cpu = all(t.device.type == "cpu" for t in tensors_in((probe.args, probe.kwargs, probe.output)))
    skip = None
    if not (on_cpu or portable):
        skip = "a backend kernel off the CPU"
    elif ctx.fsdp_managed(module):
        skip = "its parameters are FSDP2-sharded"
    elif any(is_partitioned(p) for p in module.parameters()):
        # The probe gathered them for its own runs only; gathering again would cost every rank an all-gather.
        skip = "its parameters are DeepSpeed ZeRO-3 partitioned"
    if skip is not None:
        logger.debug("kernel output check of %s skipped: %s", type(module).__qualname__, skip)
        return None
    device = next((t.device for t in tensors_in((probe.args, probe.kwargs))), torch.device("cpu"))
    try:
        # Random draws come from the probe's own generator: saving and restoring torch's process-wide one
        # (fork_rng) would rewind another thread drawing from it meanwhile.
        with torch.no_grad(), probe_behaviour(module) as behave, ProbeRandomness(ctx.generator(device)):
            behave(training=False)
            actual = built(*probe.args, **probe.kwargs)
    except Exception as exc:  # noqa: BLE001 - the kernel fails on inputs the module itself takes
        return f"it raised {type(exc).__name__}: {exc} on inputs the module's own forward takes"
    problem = _mismatch(actual, probe.output, "the output")
    return None if problem is None else f"on the probe's inputs {problem}"
