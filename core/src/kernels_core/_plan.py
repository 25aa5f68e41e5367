"""Planning: every module of a model shown to the installed layer kinds' matchers, and a kernel chosen for each
matched module where one serves it, before anything changes.

The result, a :class:`Plan`, is the report kernelize will leave on the model and one complete, immutable
:class:`~kernels_core._forward.ForwardPlan` per module that gets kernels: which kernels, what each call of its
forward checks, and the callable its kind's adapter built (each chosen kernel was tried on its module first,
:mod:`kernels_core._trial`). Strict kernelize raises here for what it cannot accept, before anything is bound.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._binding import FOREIGN_FORWARD
from ._binding import check_untouched
from ._binding import instance_overrides
from ._config import KernelsConfig
from ._config_names import check_config
from ._errors import KernelizeError
from ._forward import ForwardPlan
from ._forward import PlannedKernel
from ._kinds._context import MatchContext
from ._kinds._zero3 import ParametersInFlight
from ._plugins._diagnostics import PluginFaults
from ._plugins._diagnostics import kind_problem
from ._plugins._diagnostics import where
from ._plugins._manager import KernelsPluginManager
from ._plugins._records import ProvidedKind
from ._refs import load_ref
from ._report import KernelizeReport
from ._report import ReportEntry
from ._resolve import Assignments
from ._resolve import Resolver
from ._resolve import module_target
from ._resolve import requested_target
from ._trial import KernelTrials
from ._types import Decline
from ._types import Match
from ._types import Mode
from ._verified_families import warn_if_verified


__all__ = ["Plan", "plan_kernels"]


@dataclass(frozen=True)
class Plan:
    """What one kernelize call will do: the report it leaves on the model, and the forward of every module that
    gets kernels."""

    report: KernelizeReport
    forwards: tuple[ForwardPlan, ...] = ()


def plan_kernels(model: nn.Module, pm: KernelsPluginManager, config: KernelsConfig, mode: Mode,
                 device: str | Any | None) -> Plan:
    """Plan kernelize(``model``) in ``mode`` with the plugins of ``pm`` and ``config``, for ``device`` (None: each
    module's own). Raises :class:`KernelizeError` for what cannot be honoured (see :func:`kernels_core.kernelize`)."""
    mode_name = str(mode).removeprefix("Mode.")
    if config.disable:
        return Plan(KernelizeReport(mode=mode_name, entries=(), config_sources=config.sources,
                                    disabled=f"disabled by configuration ({', '.join(config.sources)})"))
    planner = _Planner(model, pm, config, mode, device)
    for name, module in model.named_modules():
        planner.visit(name, module)
    entries, forwards = planner.finish()
    return Plan(KernelizeReport(mode=mode_name, entries=entries, config_sources=config.sources), forwards)


def _checked_bypasses(match: Match, module: nn.Module) -> Match | Decline:
    """The match, or a decline if it names a bypassed sub-module the module does not have (a broken matcher)."""
    for child in match.bypasses:
        try:
            module.get_submodule(child)
        except AttributeError:
            return Decline(match.kind, f"the matcher says the kernel computes sub-module {child!r}, which "
                                       f"{type(module).__name__} does not have; left alone")
    return match


class _Planner:
    """One kernelize call's planning: the matchers of the usable kinds, the report rows and each module's kernels so
    far, the kernels tried (:class:`KernelTrials`) and the broken plugin code met (:class:`PluginFaults`)."""

    def __init__(self, model: nn.Module, pm: KernelsPluginManager, config: KernelsConfig, mode: Mode,
                 device: str | Any | None) -> None:
        # An earlier binding other code has wrapped since cannot be replaced without dropping that code. Forwards
        # other code put in place per instance are read before anything changes.
        check_untouched(model, "kernelize")
        self.foreign = instance_overrides(model)
        self.config, self.backends = config, pm.backends()
        self.requested = requested_target(device, self.backends) if device is not None else None
        kinds = pm.layer_kinds()
        # Every name in the configuration is checked against what pm has: undeclared options raise, other names
        # (kinds, kernels, plugins, backends) warn, naming their source.
        check_config(config, pm)
        self.resolver = Resolver(pm.kernels(), kinds, config, mode)
        self.ctx = MatchContext(model, mode=mode, options={name: config.kind(name).options for name in kinds})
        # Matchers and adapters that raise, and kernels whose output does not fit their module: warned once each.
        self.faults = PluginFaults()
        self.trials = KernelTrials(self.ctx, self.faults)
        self.entries: list[ReportEntry] = []
        self.unmet: list[ReportEntry] = []
        self.raised: dict[str, None] = {}  # kinds whose matcher raised, in the order they first did
        # id(module) -> (kernel id, enclosing module name) for modules whose forward a planned kernel never calls.
        self.covered: dict[int, tuple[str, str]] = {}
        self.assigned = Assignments()
        self.matchers = self._matchers(kinds)

    def _matchers(self, kinds: dict[str, ProvidedKind]) -> dict[str, tuple[ProvidedKind, Callable[..., Any]]]:
        """Each kind's matcher. A kind whose matcher or adapter does not load is left out, warned about once and
        reported, and the others keep working; strict kernelize raises for it."""
        matchers = {}
        for name in sorted(kinds):
            if kinds[name].kind.opt_in and not any(self.config.kind(name).prefer.values()):
                continue  # an opt-in kind nobody asked for is not visited at all (LayerKind.opt_in)
            problem = kind_problem(kinds[name])
            if problem is None:
                matchers[name] = (kinds[name], load_ref(kinds[name].kind.matcher))
                continue
            entry = ReportEntry(module="", kind=name, variant=None, device=None, backend=None, reason=problem)
            self.entries.append(entry)
            if self.config.strict_for(name):
                self.unmet.append(entry)
        return matchers

    def visit(self, name: str, module: nn.Module) -> None:
        """Show ``module`` to every matcher, and plan what each verdict asks for."""
        for kind_name, (kind, matcher) in self.matchers.items():
            verdict, failure = _verdict(matcher, module, name, self.ctx, kind_name)
            if verdict is not None:
                self._decide(name, module, kind, verdict)
            elif failure is not None:
                # One report row for the kind (see finish), not one per module: the modules were not matched.
                self.faults.matcher_raised(kind, where(name, module), *failure)
                self.raised.setdefault(kind_name, None)

    def _decide(self, name: str, module: nn.Module, kind: ProvidedKind, verdict: Match | Decline) -> None:
        """The report row of one verdict on ``module``, and its kernel, where one serves it, in the module's draft."""
        if isinstance(verdict, Match):
            verdict = _checked_bypasses(verdict, module)
        if isinstance(verdict, Decline):
            warn_if_verified(module, name, verdict, kind.plugin)
        target = module_target(module, self.requested, self.backends)
        row = {"module": name, "kind": verdict.kind, "variant": getattr(verdict, "variant", None),
               "device": target.device, "backend": target.backend}
        if isinstance(verdict, Decline):
            self.entries.append(ReportEntry(**row, reason=verdict.reason))
            return
        if id(module) in self.covered:
            kernel_id, owner = self.covered[id(module)]
            self.entries.append(ReportEntry(**row, covered_by=kernel_id, covered_on=owner,
                                            reason=f"covered by {kernel_id} on {owner or '(model)'}, which computes "
                                                   "this module itself: its forward never runs"))
            return
        foreign = self.foreign.get(id(module)) if kind.kind.target == "forward" else None
        if foreign is not None:
            # Code that wraps a forward per instance may do more than compute (transformers' tensor parallel
            # registers its gradient all-reduce hooks there on the first call): a kernel in its place would
            # silently skip that. accelerate's hooks are not in this case: kernels go inside them.
            what = getattr(foreign, "__qualname__", None) or type(foreign).__qualname__
            self.entries.append(ReportEntry(**row, reason=f"{FOREIGN_FORWARD} ({what}); a kernel would bypass it, "
                                                          "so the module is left alone"))
            return
        options = dict(self.config.kind(kind.kind.name).options)
        built: dict[str, Any] = {}
        choice = self.resolver.choose(verdict, target, verify=functools.partial(
            self._trial, module, name, kind, verdict, options, built))
        if choice.kernel is None:
            entry = ReportEntry(**row, reason=choice.reason, left_to_compiler=choice.left_to_compiler)
            self.entries.append(entry)
            if choice.unmet and self.config.strict_for(kind.kind.name):
                self.unmet.append(entry)
            return
        spec, plugin = choice.kernel.spec, choice.kernel.plugin
        planned = PlannedKernel(choice.kernel, kind, verdict, options, preferred=choice.note == "preferred by config")
        clash = self.assigned.add(name, module, planned, built.get(spec.id))
        if clash is not None:
            self.entries.append(ReportEntry(**row, reason=f"module forward already taken by kernel {clash}"))
            return
        self.entries.append(ReportEntry(**row, kernel=spec.id, plugin=plugin.name, distribution=plugin.distribution,
                                        version=plugin.version, note=choice.note))
        for child in verdict.bypasses:
            for inner in module.get_submodule(child).modules():
                self.covered.setdefault(id(inner), (spec.id, name))

    def _trial(self, module: nn.Module, name: str, kind: ProvidedKind, match: Match, options: dict[str, object],
               built: dict[str, Any], kernel: Any) -> str | None:
        """Why ``kernel`` cannot serve the module after all, or None, keeping what the kind's adapter built for it.

        The adapter builds the module's forward while planning, checked against the matcher's probe where there is
        one: a broken adapter or a kernel returning the wrong shape falls back like an impl that does not import.
        """
        built[kernel.spec.id], problem = self.trials.run(module, name, kind, match, kernel, options)
        return problem

    def finish(self) -> tuple[tuple[ReportEntry, ...], tuple[ForwardPlan, ...]]:
        """Every report row, and every module's complete plan; raises for what strict kernelize cannot accept."""
        self.faults.warn()
        messages = {fault.subject: message for fault, message in self.faults.messages()}
        self.entries.extend(ReportEntry(module="", kind=name, variant=None, device=None, backend=None,
                                        reason=messages[f"kind:{name}"])
                            for name in self.raised if f"kind:{name}" in messages)
        broken = self.faults.strict_problems(self.config.strict_for)
        if self.unmet or broken:
            problems = []
            if broken:
                problems.append(f"{len(broken)} piece(s) of broken plugin code: {'; '.join(broken)}")
            if self.unmet:
                details = "; ".join(f"{e.module} ({e.kind}): {e.reason}" for e in self.unmet[:10])
                problems.append(f"{len(self.unmet)} matched module(s) got no kernel: {details}")
            raise KernelizeError(f"strict kernelize: {'. '.join(problems)}") from self.faults.first_error(
                self.config.strict_for)
        return tuple(self.entries), self.assigned.plans(device_checked=self.requested is None)


def _verdict(matcher: Callable[..., Any], module: nn.Module, name: str, ctx: MatchContext, kind: str
             ) -> tuple[Match | Decline | None, tuple[str, BaseException] | None]:
    """The matcher's verdict on ``module``, or, where the matcher raised, what it raised: uncertain means left alone,
    with the reason. A module whose parameters DeepSpeed holds elsewhere is declined."""
    try:
        return matcher(module, name, ctx), None
    except ParametersInFlight as exc:
        return Decline(kind, str(exc)), None
    except Exception as exc:  # noqa: BLE001 - one kind's broken matcher leaves its modules alone, nothing else
        return None, (f"{type(exc).__name__}: {exc}", exc)
