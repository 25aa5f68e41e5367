"""``kernelize`` and ``unkernelize``: plan every module first, then bind all or nothing."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import TypeVar

import torch
from torch import nn

from ._binding import BINDING_ATTR
from ._binding import FOREIGN_FORWARD
from ._binding import Changes
from ._binding import bind
from ._binding import check_untouched
from ._binding import instance_override
from ._binding import unbind
from ._config import KernelsConfig
from ._config import load_config
from ._config_check import check_config
from ._forward import Declared
from ._forward import GlobalOverride
from ._forward import KernelForward
from ._forward import ReroutedForward
from ._forward import takes_base
from ._kinds._context import MatchContext
from ._kinds._context import module_device
from ._kinds._context import param_dtype
from ._kinds._zero3 import ParametersInFlight
from ._manager import KernelsPluginManager
from ._manager import ProvidedKernel
from ._manager import ProvidedKind
from ._manager import get_plugin_manager
from ._refs import load_ref
from ._report import KernelizeReport
from ._report import ReportEntry
from ._resolve import KernelizeError
from ._resolve import Resolver
from ._resolve import Target
from ._types import BackendInfo
from ._types import Binding
from ._types import Decline
from ._types import DeviceInfo
from ._types import Match
from ._types import Mode
from ._types import device_name
from ._verified import warn_if_verified
from ._verify import KernelChecks
from ._verify import PluginFaults


__all__ = ["get_report", "kernelize", "unkernelize"]

logger = logging.getLogger("kernels_core")

REPORT_ATTR = "_kernels_core_report"
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass
class _Planned:
    name: str
    module: nn.Module
    kind: ProvidedKind
    match: Match
    kernel: ProvidedKernel
    options: dict[str, object]
    # What the kind's adapter built for this module while planning (None for global kinds: their forward is
    # rebuilt with every rerouted global at bind time).
    built: Any = None


@dataclass
class _ModulePlan:
    name: str
    module: nn.Module
    forward: _Planned | None = None
    globals: list[_Planned] = field(default_factory=list)


def _resolve_mode(model: nn.Module, mode: Mode | None) -> Mode:
    if mode is None:
        return Mode.TRAINING if model.training else Mode.INFERENCE
    if not isinstance(mode, Mode):
        raise TypeError(f"mode must be a kernels_core.Mode (INFERENCE or TRAINING, optionally | TORCH_COMPILE), "
                        f"got {mode!r}")
    return mode.validate()


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _find_backend(device: torch.device, backends: list[tuple[BackendInfo, Any]]
                  ) -> tuple[BackendInfo | None, DeviceInfo | None]:
    for backend, _plugin in backends:
        if backend.device_type == device.type:
            # A device type without an index ("cuda") means its backend's first device.
            info = backend.device(device.index) if device.index is not None else next(iter(backend.devices), None)
            if info is not None:
                return backend, info
    return None, None


def _explicit_target(device: str | torch.device, backends: list[tuple[BackendInfo, Any]]
                     ) -> tuple[str, BackendInfo, DeviceInfo | None]:
    detected = sorted({f"{b.backend} ({', '.join(device_name(b.device_type, d.index) for d in b.devices)})"
                       for b, _ in backends if b.devices})
    absent = sorted({f"{b.backend}: {b.reason}" for b, _ in backends if not b.devices and b.reason})
    # Devices are named as a tensor on them prints its device ("cpu", "cuda:0", "npu:1"), whether the request
    # named a backend ("rocm"), a device type ("cuda") or a device ("cuda:1").
    if isinstance(device, str) and ":" not in device:
        for backend, _plugin in backends:
            if backend.backend == device and backend.devices:
                info = backend.devices[0]
                return device_name(backend.device_type, info.index), backend, info
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        torch_device = None
    if torch_device is not None:
        backend, info = _find_backend(torch_device, backends)
        if backend is not None:
            index = info.index if info is not None else (torch_device.index or 0)
            return device_name(torch_device.type, index), backend, info
    why = f"; not available: {'; '.join(absent)}" if absent else ""
    raise KernelizeError(f"device {device!r} was requested, but no installed plugin detected it. "
                         f"Detected: {detected or 'nothing'}{why}")


def _module_target(module: nn.Module, explicit: tuple[str, BackendInfo, DeviceInfo | None] | None,
                   backends: list[tuple[BackendInfo, Any]]) -> Target:
    # The loss kernel runs where lm_head lives, which under device_map can differ from the embeddings.
    anchor = module.lm_head if isinstance(module._modules.get("lm_head"), nn.Module) else module
    dtype = _dtype_name(param_dtype(anchor))
    if explicit is not None:
        name, backend, info = explicit
        return Target(device=name, backend=backend.backend, device_info=info, dtype=dtype)
    device = module_device(anchor)
    if device is None:
        return Target(device=None, backend=None, device_info=None, dtype=dtype)
    backend, info = _find_backend(device, backends)
    # A parameter's device is already named as tensors print it.
    return Target(device=str(device), backend=backend.backend if backend else device.type, device_info=info,
                  dtype=dtype)


def _entry(name: str, match: Match | Decline, target: Target, **extra: Any) -> ReportEntry:
    return ReportEntry(module=name, kind=match.kind, variant=getattr(match, "variant", None), device=target.device,
                       backend=target.backend, **extra)


def _validate_binding(binding: object, module_name: str, kernel_id: str, plugin: str) -> Binding:
    if not isinstance(binding, Binding):
        raise KernelizeError(f"plugin {plugin!r} returned {type(binding).__name__} from kernels_core_bind_kernel "
                             f"for {kernel_id} on {module_name}; expected kernels_core.Binding or None")
    for attr, value in binding.attributes.items():
        if isinstance(value, (nn.Module, torch.Tensor)):
            raise KernelizeError(f"plugin {plugin!r} tried to bind a module/tensor to {module_name}.{attr}; "
                                 "bindings must not change parameters, buffers or sub-modules")
    return binding


def _plan(model: nn.Module, pm: KernelsPluginManager, config: KernelsConfig, mode: Mode,
          explicit: tuple[str, BackendInfo, DeviceInfo | None] | None
          ) -> tuple[list[_ModulePlan], list[ReportEntry], list[ReportEntry], list[str], BaseException | None]:
    kinds = pm.layer_kinds()
    # Every name in the configuration is checked against what pm has: undeclared options raise, other names
    # (kinds, kernels, plugins, backends) warn, naming their source.
    check_config(config, pm)
    backends = pm.backends()
    resolver = Resolver(pm, config, mode)
    # id(module) -> (kernel id, enclosing module name) for modules whose forward a planned kernel never calls.
    covered: dict[int, tuple[str, str]] = {}
    ctx = MatchContext(model, mode=mode, options={name: config.kind(name).options for name in kinds})
    # Matchers and adapters that raise, and kernels whose output does not fit their module: warned once each.
    faults = PluginFaults()
    checks = KernelChecks(ctx, faults)
    matchers = {}
    raised: dict[str, object] = {}
    unusable: list[ReportEntry] = []
    for name in sorted(kinds):
        if kinds[name].kind.opt_in and not any(config.kind(name).prefer.values()):
            continue  # an opt-in kind nobody asked for is not visited at all (LayerKind.opt_in)
        # A kind whose matcher or adapter does not load is left out, warned about once and reported; the others
        # keep working. Strict kernelize raises for it.
        problem = pm.kind_problem(name)
        if problem is not None:
            unusable.append(ReportEntry(module="", kind=name, variant=None, device=None, backend=None, reason=problem))
            continue
        matchers[name] = load_ref(kinds[name].kind.matcher)
    plans: dict[int, _ModulePlan] = {}
    entries: list[ReportEntry] = list(unusable)
    unmet: list[ReportEntry] = [e for e in unusable if config.strict_for(e.kind)]
    for module_name, module in model.named_modules():
        for kind_name, matcher in matchers.items():
            provided_kind = kinds[kind_name]
            try:
                verdict = matcher(module, module_name, ctx)
            except ParametersInFlight as exc:
                verdict = Decline(kind_name, str(exc))
            except Exception as exc:  # noqa: BLE001 - uncertain means left alone, with the reason
                owner = provided_kind.plugin
                # One report row for the kind (below), not one per module: the modules were not matched.
                faults.matcher_raised(provided_kind, module_name, module, f"{type(exc).__name__}: {exc}", exc)
                raised.setdefault(kind_name, owner)
                continue
            if verdict is None:
                continue
            if isinstance(verdict, Match):
                verdict = _checked_bypasses(verdict, module)
            target = _module_target(module, explicit, backends)
            if isinstance(verdict, Decline):
                warn_if_verified(module, module_name, verdict, provided_kind.plugin)
                entries.append(_entry(module_name, verdict, target, reason=verdict.reason))
                continue
            if id(module) in covered:
                kernel_id, owner = covered[id(module)]
                entries.append(_entry(module_name, verdict, target, covered_by=kernel_id, covered_on=owner,
                                      reason=f"covered by {kernel_id} on {owner or '(model)'}, which computes this "
                                             "module itself: its forward never runs"))
                continue
            foreign = instance_override(module) if provided_kind.kind.target == "forward" else None
            if foreign is not None:
                # Code that wraps a forward per instance may do more than compute (transformers' tensor parallel
                # registers its gradient all-reduce hooks there on the first call): a kernel in its place would
                # silently skip that. accelerate's hooks are not in this case: kernels go inside them.
                what = getattr(foreign, "__qualname__", None) or type(foreign).__qualname__
                entries.append(_entry(module_name, verdict, target,
                                      reason=f"{FOREIGN_FORWARD} ({what}); a kernel would bypass it, so the "
                                             "module is left alone"))
                continue
            options = dict(config.kind(kind_name).options)
            built: dict[str, Any] = {}
            choice = resolver.choose(verdict, target, verify=functools.partial(
                _build_checked, checks, module, module_name, provided_kind, verdict, options, built))
            if choice.kernel is None:
                entry = _entry(module_name, verdict, target, reason=choice.reason,
                               left_to_compiler=choice.left_to_compiler)
                entries.append(entry)
                if choice.unmet and config.strict_for(kind_name):
                    unmet.append(entry)
                continue
            plan = plans.setdefault(id(module), _ModulePlan(module_name, module))
            planned = _Planned(module_name, module, provided_kind, verdict, choice.kernel, options,
                               built.get(choice.kernel.spec.id) if provided_kind.kind.target == "forward" else None)
            spec, plugin = choice.kernel.spec, choice.kernel.plugin
            # One forward per module: a forward-target kernel and rerouted globals cannot both own it.
            if plan.forward is not None:
                clash: str | None = plan.forward.kernel.spec.id
            elif provided_kind.kind.target == "forward" and plan.globals:
                clash = plan.globals[0].kernel.spec.id
            else:
                clash = _global_clash(plan.globals, provided_kind, verdict)
            if provided_kind.kind.target == "forward" and clash is None:
                plan.forward = planned
            elif provided_kind.kind.target == "global" and clash is None:
                plan.globals.append(planned)
            else:
                entries.append(_entry(module_name, verdict, target,
                                      reason=f"module forward already taken by kernel {clash}"))
                continue
            entries.append(_entry(module_name, verdict, target, kernel=spec.id, plugin=plugin.name,
                                  distribution=plugin.distribution, version=plugin.version, note=choice.note))
            for child in verdict.bypasses:
                for inner in module.get_submodule(child).modules():
                    covered.setdefault(id(inner), (spec.id, module_name))
    faults.warn()
    messages = {fault.subject: message for fault, message in faults.messages()}
    entries.extend(ReportEntry(module="", kind=name, variant=None, device=None, backend=None,
                               reason=messages[f"kind:{name}"]) for name in raised if f"kind:{name}" in messages)
    return (list(plans.values()), entries, unmet, faults.strict_problems(config.strict_for),
            faults.first_error(config.strict_for))


def _global_clash(planned: list[_Planned], kind: ProvidedKind, match: Match) -> str | None:
    """The kernel already rerouting the same global in this module's forward that this kind cannot build on."""
    if kind.kind.target != "global" or takes_base(load_ref(kind.kind.adapter)):
        return None
    name = match.params.get("global_name")
    return next((p.kernel.spec.id for p in planned if p.match.params.get("global_name") == name
                 and not takes_base(load_ref(p.kind.kind.adapter))), None)


def _build_checked(checks: KernelChecks, module: nn.Module, name: str, kind: ProvidedKind, match: Match,
                   options: dict[str, object], built: dict[str, Any], kernel: ProvidedKernel) -> str | None:
    """Why ``kernel`` cannot serve the module after all, or None, keeping what the kind's adapter built for it.

    The adapter builds the module's forward while planning, checked against the matcher's probe where there is
    one: a broken adapter or a kernel returning the wrong shape falls back like an impl that does not import.
    """
    built[kernel.spec.id], problem = checks.build(module, name, kind, match, kernel, options)
    return problem


def _checked_bypasses(match: Match, module: nn.Module) -> Match | Decline:
    """The match, or a decline if it names a bypassed sub-module the module does not have (a broken matcher)."""
    for child in match.bypasses:
        try:
            module.get_submodule(child)
        except AttributeError:
            return Decline(match.kind, f"the matcher says the kernel computes sub-module {child!r}, which "
                                       f"{type(module).__name__} does not have; left alone")
    return match


def _built_or_raise(forward: KernelForward | ReroutedForward, name: str, module: nn.Module,
                    planned: list[_Planned]) -> Any:
    """The forward's callable, built through its kinds' adapters; a failure names every kernel involved."""
    try:
        return forward._build()
    except Exception as exc:
        kernels = "; ".join(
            f"kernel {p.kernel.spec.id!r} of plugin {p.kernel.plugin.name!r} (distribution "
            f"{p.kernel.plugin.distribution or 'unknown'}), kind {p.kind.kind.name!r} (adapter "
            f"{p.kind.kind.adapter} of plugin {p.kind.plugin.name!r}, impl {p.kernel.spec.impl})" for p in planned)
        ids = ", ".join(f'"{p.kernel.spec.id}"' for p in planned)
        raise KernelizeError(
            f"binding to module {name or '(model)'!r} ({type(module).__qualname__}) failed while building its "
            f"forward: {kernels}: {type(exc).__name__}: {exc}. The model is unchanged; to kernelize without it, "
            f"set kernels.disable = [{ids}]") from exc


def _bind_plan(plan: _ModulePlan, pm: KernelsPluginManager, changes: Changes) -> None:
    module = plan.module
    if plan.forward is not None:
        p = plan.forward
        forward = KernelForward(module, kernel_id=p.kernel.spec.id, kind=p.kind.kind.name, impl=p.kernel.spec.impl,
                                adapter=p.kind.kind.adapter, match=p.match, options=p.options,
                                plugin=p.kernel.plugin.name, origin=p.kernel.plugin.origin, module_name=plan.name)
        binding: object = None
        hook = pm.bind_hook_of(p.kernel.plugin.name)
        if hook is not None:
            try:
                binding = hook(module=module, match=p.match, kernel=p.kernel.spec, forward=forward)
            except Exception as exc:
                raise KernelizeError(f"plugin {p.kernel.plugin.name!r} ({p.kernel.plugin.origin}) failed to bind "
                                     f"kernel {p.kernel.spec.id} to {plan.name}: {type(exc).__name__}: {exc}") from exc
        if binding is None:
            binding = pm.default_binding(module=module, match=p.match, kernel=p.kernel.spec, forward=forward)
            # Built while planning (a broken adapter fell back there); else now, so that a failure happens inside
            # the transaction, not at the first forward.
            forward._fn = p.built if p.built is not None else _built_or_raise(forward, plan.name, module, [p])
        binding = _validate_binding(binding, plan.name, p.kernel.spec.id, p.kernel.plugin.name)
        bind(changes, module, dict(binding.attributes), ((p.kind.kind.name, p.kernel.spec.id),))
        return
    overrides = tuple(
        GlobalOverride(kernel_id=p.kernel.spec.id, kind=p.kind.kind.name,
                       global_name=str(p.match.params["global_name"]), impl=p.kernel.spec.impl,
                       adapter=p.kind.kind.adapter, match=p.match, options=p.options,
                       plugin=p.kernel.plugin.name, origin=p.kernel.plugin.origin)
        for p in plan.globals
    )
    rerouted = ReroutedForward(module, overrides=overrides, module_name=plan.name)
    rerouted._fn = _built_or_raise(rerouted, plan.name, module, plan.globals)
    bind(changes, module, {"forward": rerouted}, tuple((o.kind, o.kernel_id) for o in overrides))


def kernelize(
    model: ModelT,
    *,
    mode: Mode | None = None,
    device: str | torch.device | None = None,
    config: dict[str, Any] | str | KernelsConfig | None = None,
    strict: bool = False,
    plugin_manager: KernelsPluginManager | None = None,
) -> ModelT:
    """Bind the best available kernel to every module whose math a kernel implements, per instance.

    Every module is classified and every choice made before anything changes; then all bindings are applied,
    or, if one fails, none. Kernelizing again re-resolves from scratch; :func:`unkernelize` restores every
    module exactly. The outcome is available from :func:`get_report`.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE) is model
        True

    Args:
        model: the model (any ``nn.Module``); modified in place and returned.
        mode: ``Mode.INFERENCE`` or ``Mode.TRAINING``, optionally ``| Mode.TORCH_COMPILE``; defaults to
            ``model.training``.
        device: resolve every module as if it ran on this device or backend (``"cuda:1"``, ``"npu"``,
            ``"rocm"``; a backend or device type means its first detected device); by default each module's own
            device decides, so ``device_map`` models get a choice per device. The report names the device as a
            tensor on it prints its device (``device="rocm"`` reports ``cuda:0``).
        config: a dict or TOML path, overriding the environment and file configuration.
        strict: raise if a matched module that could get a kernel on its backend got none. A module could get
            one when an installed kernel of its kind declares the module's backend (or ``"any"``) and
            configuration does not disable that kernel, its plugin or the kind; such a module left without a
            kernel (variant, mode, dtype, capability, architecture, a missing requirement or a load failure ruled
            every such kernel out) raises, and so does broken plugin code met on the way, even where another
            kernel took over: a matcher or adapter that raised, a kernel whose output on the matcher's probe did
            not have the module's shape, dtype or device. A kind with no kernel for the backend at all, a kind or
            kernel disabled by configuration, a declined module (its math differs), a module left alone because
            other code replaced its forward, and a module covered by an enclosing module's kernel are reported,
            never fatal. ``strict = true`` in the configuration means the same; ``[kinds.<name>] strict`` applies
            the rule to one kind (``false`` exempts it). Names in the configuration are not affected: those that
            match nothing installed warn either way (``core/docs/configuration.md``, "Strictness").
        plugin_manager: use this manager instead of the process-wide one (tests, embedding frameworks).

    Raises:
        KernelizeError: an explicit request (``device``, ``strict``, a configured preference) cannot be
            honoured, binding failed, or other code replaced an attribute an earlier kernelize bound (a wrapper
            re-kernelizing would drop); the model is unchanged.
        ConfigError: the configuration is malformed or names an option its kind does not declare. A layer kind,
            kernel, plugin or backend name that is not installed warns with :class:`~kernels_core.ConfigWarning`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize expects a torch.nn.Module, got {type(model).__name__}")
    resolved_mode = _resolve_mode(model, mode)
    cfg = load_config(config)
    if strict:
        cfg = dataclasses.replace(cfg, strict=True)
    pm = plugin_manager or get_plugin_manager()
    mode_name = str(resolved_mode).removeprefix("Mode.")
    if cfg.disable:
        report = KernelizeReport(mode=mode_name, entries=(), config_sources=cfg.sources,
                                 disabled=f"disabled by configuration ({', '.join(cfg.sources)})")
        model.__dict__[REPORT_ATTR] = report
        logger.info(report.summary())
        return model
    check_untouched(model, "kernelize")
    explicit = _explicit_target(device, pm.backends()) if device is not None else None
    plans, entries, unmet, broken, cause = _plan(model, pm, cfg, resolved_mode, explicit)
    if unmet or broken:
        problems = []
        if broken:
            problems.append(f"{len(broken)} piece(s) of broken plugin code: {'; '.join(broken)}")
        if unmet:
            details = "; ".join(f"{e.module} ({e.kind}): {e.reason}" for e in unmet[:10])
            problems.append(f"{len(unmet)} matched module(s) got no kernel: {details}")
        raise KernelizeError(f"strict kernelize: {'. '.join(problems)}") from cause
    with Changes() as changes:
        for module in model.modules():
            unbind(changes, module)
        for plan in plans:
            _bind_plan(plan, pm, changes)
        _guard_forwards(plans, entries, device_checked=explicit is None)
        report = KernelizeReport(mode=mode_name, entries=tuple(entries), config_sources=cfg.sources)
        changes.set(model.__dict__, {REPORT_ATTR: report})
    # A sub-module kernelized on its own (the model inside a PEFT or accelerate wrapper) had its bindings replaced
    # by this call: its report described those.
    _drop_reports(model, keep_root=True)
    logger.info(report.summary())
    return model


def unkernelize(model: ModelT) -> ModelT:
    """Undo every binding kernelize made on ``model`` and its sub-modules, restoring them exactly.

    ``model`` may be a wrapper holding the kernelized model as a sub-module (PEFT, DDP): the report of every module
    under it is dropped with the bindings.

    Raises :class:`KernelizeError`, changing nothing, if other code replaced an attribute kernelize bound since
    (accelerate's mixed-precision wrapper, an accelerate hook, TRL's fused LM head): restoring it would drop that
    code. The error names the module, the attribute and what replaced it.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
        >>> kernels_core.unkernelize(model) is model
        True
    """
    check_untouched(model, "unkernelize")
    changes = Changes()
    restored = sum(unbind(changes, module) for module in model.modules())
    # Through a wrapper (PEFT, accelerate, DDP hold the kernelized model as a sub-module) too: every report under
    # it described bindings that are gone now.
    _drop_reports(model, keep_root=False)
    logger.info("unkernelize: restored %d module(s)", restored)
    return model


def get_report(model: nn.Module) -> KernelizeReport | None:
    """The report of the last kernelize call on ``model``, true to the model as it is now; None if it was never
    kernelized or was restored.

    A kernel that no longer runs where kernelize bound it shows as not applied, its id in ``fell_back`` and the
    reason in ``reason``: the model was converted to a dtype the kernel does not declare (``model.double()``) or
    moved to another device type, or loaded where the kernel is not installed or cannot be built, so the module's
    own forward runs; or its binding was removed since. Modules covered by such a kernel run their own forward
    again and say so.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
        >>> kernels_core.get_report(model).mode
        'INFERENCE'
        >>> kernels_core.get_report(kernels_core.unkernelize(model)) is None
        True
    """
    report = model.__dict__.get(REPORT_ATTR)
    if report is None or report.disabled:
        return report
    return _as_now(model, report)


def _drop_reports(model: nn.Module, *, keep_root: bool) -> None:
    for module in model.modules():
        if not (keep_root and module is model):
            module.__dict__.pop(REPORT_ATTR, None)


def _probe(module: nn.Module) -> tuple[nn.Module, str, torch.Tensor] | None:
    """The parameter whose dtype kernelize resolved ``module`` by (see ``_module_target``): its module, name, value."""
    anchor = module.lm_head if isinstance(module._modules.get("lm_head"), nn.Module) else module
    for name, tensor in anchor.named_parameters():
        if tensor.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            return anchor.get_submodule(owner), leaf, tensor
    return None


def _bound_forward(module: nn.Module) -> KernelForward | ReroutedForward | None:
    record = module.__dict__.get(BINDING_ATTR)
    forwards = [v for v in record.bound.values() if isinstance(v, (KernelForward, ReroutedForward))] if record else []
    return forwards[0] if len(forwards) == 1 else None


def _guard_forwards(plans: list[_ModulePlan], entries: list[ReportEntry], *, device_checked: bool) -> None:
    """Give every bound forward what its kernels serve, which each call checks (``_LazyForward.guard``).

    The device type is checked only where each module's own device decided the kernels: kernelize told the device
    the model will run on binds kernels for that device before the model is there.
    """
    preferred = {(e.module, e.kernel) for e in entries if e.note == "preferred by config"}
    for plan in plans:
        forward = _bound_forward(plan.module)
        if forward is None:
            continue  # a plugin's own binding: its kernels run as bound
        # Without a floating-point parameter nothing is checked per call.
        probe = _probe(plan.module)
        device_type = probe[2].device.type if probe is not None and device_checked else None
        planned = [plan.forward] if plan.forward is not None else plan.globals
        forward.guard(tuple(
            Declared(kernel_id=p.kernel.spec.id, plugin=p.kernel.plugin.name, origin=p.kernel.plugin.origin,
                     dtypes=p.kernel.spec.dtypes, backend=p.kernel.spec.backend,
                     device_type=None if p.kernel.spec.portable else device_type,
                     preferred=(plan.name, p.kernel.spec.id) in preferred)
            for p in planned), probe=probe[:2] if probe is not None else None)


def _binding_state(model: nn.Module, name: str) -> tuple[str | None, set[str], dict[str, str]]:
    """For module ``name``: why none of its kernels runs (or None), the kernels bound to it, why each does not run."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return "the module is no longer in the model", set(), {}
    # torch.compile(module) put in its place (each decoder layer compiled, as FSDP2 recipes do) calls the module it
    # wraps, ``_orig_mod``, whose binding then runs.
    while BINDING_ATTR not in module.__dict__ and isinstance(module._modules.get("_orig_mod"), nn.Module):
        module = module._modules["_orig_mod"]
    record = module.__dict__.get(BINDING_ATTR)
    if record is None:
        return ("its binding was removed since kernelize (unkernelize of a part of the model, or a copy of that "
                "part)"), set(), {}
    forward = _bound_forward(module)
    failing = forward.runtime_problems() if forward is not None else []
    then = ("each call raises KernelizeError, since configuration prefers it" if any(d.preferred for d, _ in failing)
            else "the module's own forward runs instead")
    problems = {declared.kernel_id: f"{cause}; {then}" for declared, cause in failing}
    bound = {kernel_id for _, kernel_id in record.kernels}
    for kernel_id in bound - set(problems):
        if failing:
            # One rerouted forward: where one of its kernels cannot run, the class forward runs without any.
            problems[kernel_id] = f"another kernel of the same forward cannot run ({failing[0][1]}); {then}"
    return None, bound, problems


def _not_running(model: nn.Module, name: str, kernel_id: str,
                 seen: dict[str, tuple[str | None, set[str], dict[str, str]]]) -> str | None:
    """Why kernel ``kernel_id`` bound to module ``name`` does not run now, or None if it does."""
    if name not in seen:
        seen[name] = _binding_state(model, name)
    gone, bound, problems = seen[name]
    if gone:
        return gone
    if kernel_id not in bound:
        return "its binding was replaced since kernelize"
    return problems.get(kernel_id)


def _as_now(model: nn.Module, report: KernelizeReport) -> KernelizeReport:
    """``report`` with every kernel that does not run now where it was bound shown as fallen back."""
    seen: dict[str, tuple[str | None, set[str], dict[str, str]]] = {}
    entries = []
    for entry in report.entries:
        if entry.applied:
            why = _not_running(model, entry.module, entry.kernel, seen)
            if why:
                entry = dataclasses.replace(entry, kernel=None, fell_back=entry.kernel,
                                            reason=f"{entry.kernel} does not run now: {why}")
        elif entry.covered:
            why = _not_running(model, entry.covered_on, entry.covered_by, seen)
            if why:
                # Worded like a covered row's table text, so the table collapses numbered layers alike.
                entry = dataclasses.replace(entry, fell_back=entry.covered_by,
                                            reason=f"covered by {entry.covered_by} on {entry.covered_on or '(model)'}"
                                                   f", which does not run now: {why}")
        entries.append(entry)
    if all(new is old for new, old in zip(entries, report.entries, strict=True)):
        return report
    return dataclasses.replace(report, entries=tuple(entries))
