"""Where a matched module runs (its :class:`Target`: device, backend, dtype), choosing a kernel for it there or
saying exactly why none fits, and the kernels each module was given (:class:`Assignments`), from which every
module's :class:`~kernels_core._forward.ForwardPlan` is made.

A module's target is read from its parameters: their device and dtype, those of its ``lm_head`` for a model with one
(the loss kernel runs where ``lm_head`` lives, which under ``device_map`` can differ from the embeddings), unless
kernelize was told the device the model will run on (:func:`requested_target`).

Priority is data: qualifying kernels sort by (priority high first, plugin name, kernel id), so the outcome never
depends on the order plugins were registered in. Configured preferences come first and raise when they
cannot be honoured; automatic choices fall back to the next candidate and record why.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

from ._config import KernelsConfig
from ._errors import KernelizeError
from ._forward import ForwardPlan
from ._forward import PlannedKernel
from ._forward import takes_base
from ._plugins._diagnostics import requirement_problem
from ._plugins._fallbacks import note_fallback
from ._plugins._records import ProvidedKernel
from ._plugins._records import ProvidedKind
from ._refs import load_ref
from ._types import BackendInfo
from ._types import DeviceInfo
from ._types import Match
from ._types import Mode
from ._types import Supports
from ._types import device_name


if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "Assignments",
    "Choice",
    "Resolver",
    "Target",
    "find_backend",
    "module_target",
    "probe_parameter",
    "requested_target",
]

logger = logging.getLogger("kernels_core")  # the package's one logger


@dataclass(frozen=True)
class Target:
    """Where a matched module runs: its device, the backend that drives it, and that device's properties."""

    device: str | None
    backend: str | None
    device_info: DeviceInfo | None
    dtype: str | None


def find_backend(device: torch.device, backends: list[tuple[BackendInfo, Any]]
                 ) -> tuple[BackendInfo | None, DeviceInfo | None]:
    """The detected backend driving ``device`` and that device's properties, or (None, None)."""
    for backend, _plugin in backends:
        if backend.device_type == device.type:
            # A device type without an index ("cuda") means its backend's first device.
            info = next((d for d in backend.devices if device.index is None or d.index == device.index), None)
            if info is not None:
                return backend, info
    return None, None


def requested_target(device: str | torch.device, backends: list[tuple[BackendInfo, Any]]) -> Target:
    """The target of every module when kernelize is told the device (``"cuda:1"``, ``"npu"``, ``"rocm"``), each
    module's dtype left to :func:`module_target`; raises :class:`KernelizeError` where no plugin detected it."""
    import torch

    detected = sorted({f"{b.backend} ({', '.join(device_name(b.device_type, d.index) for d in b.devices)})"
                       for b, _ in backends if b.devices})
    absent = sorted({f"{b.backend}: {b.reason}" for b, _ in backends if not b.devices and b.reason})
    # Devices are named as a tensor on them prints its device ("cpu", "cuda:0", "npu:1"), whether the request
    # named a backend ("rocm"), a device type ("cuda") or a device ("cuda:1").
    if isinstance(device, str) and ":" not in device:
        for backend, _plugin in backends:
            if backend.backend == device and backend.devices:
                info = backend.devices[0]
                return Target(device_name(backend.device_type, info.index), backend.backend, info, None)
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError):
        torch_device = None
    if torch_device is not None:
        backend, info = find_backend(torch_device, backends)
        if backend is not None:
            index = info.index if info is not None else (torch_device.index or 0)
            return Target(device_name(torch_device.type, index), backend.backend, info, None)
    why = f"; not available: {'; '.join(absent)}" if absent else ""
    raise KernelizeError(f"device {device!r} was requested, but no installed plugin detected it. "
                         f"Detected: {detected or 'nothing'}{why}")


def _anchor(module: nn.Module) -> nn.Module:
    """The module whose parameters say where ``module`` runs: its ``lm_head`` where it has one, else itself."""
    from torch import nn

    head = module._modules.get("lm_head")
    return head if isinstance(head, nn.Module) else module


def _device(anchor: nn.Module) -> torch.device | None:
    """The device of the module's first parameter (or, without any, of its first buffer)."""
    tensors = itertools.chain(anchor.parameters(), anchor.buffers())
    return next((tensor.device for tensor in tensors), None)


def probe_parameter(module: nn.Module) -> tuple[nn.Module, str, torch.Tensor] | None:
    """The parameter whose dtype says what ``module`` computes in (its module, name and value): the first
    floating-point one of the module, or of its ``lm_head``. Each call of its kernelized forward checks it."""
    anchor = _anchor(module)
    for name, tensor in anchor.named_parameters():
        if tensor.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            return anchor.get_submodule(owner), leaf, tensor
    return None


def module_target(module: nn.Module, requested: Target | None, backends: list[tuple[BackendInfo, Any]]) -> Target:
    """Where ``module`` runs: ``requested`` (kernelize was told the device) or its parameters' device, with the
    backend driving it; and its parameters' dtype (:func:`probe_parameter`)."""
    probe = probe_parameter(module)
    dtype = None if probe is None else str(probe[2].dtype).removeprefix("torch.")
    if requested is not None:
        return dataclasses.replace(requested, dtype=dtype)
    device = _device(_anchor(module))
    if device is None:
        return Target(device=None, backend=None, device_info=None, dtype=dtype)
    backend, info = find_backend(device, backends)
    # A parameter's device is already named as tensors print it.
    return Target(device=str(device), backend=backend.backend if backend else device.type, device_info=info,
                  dtype=dtype)


@dataclass(frozen=True)
class Choice:
    """The kernel chosen for one module, or why there is none.

    ``unmet`` is true when no kernel was chosen although the module could have had one: an installed kernel of
    its kind declares the module's backend (or ``"any"``) and configuration does not disable it; it was passed
    over for its variant, mode, dtype, capability, architecture, requirements or a failure to load. Strict
    kernelize raises for exactly these modules. ``left_to_compiler`` names the kernel that would have been chosen
    when the module is left on its own forward for torch.compile instead (``KernelSpec.native_when_compiled``).
    """

    kernel: ProvidedKernel | None
    reason: str | None = None
    note: str | None = None
    unmet: bool = False
    left_to_compiler: str | None = None


class Resolver:
    """Kernel choice for one kernelize call: one mode, one configuration, the installed ``kernels`` and ``kinds``."""

    def __init__(self, kernels: list[ProvidedKernel], kinds: dict[str, ProvidedKind], config: KernelsConfig,
                 mode: Mode) -> None:
        self.config = config
        self.mode = mode
        self._by_kind: dict[str, list[ProvidedKernel]] = {}
        for provided in kernels:
            self._by_kind.setdefault(provided.spec.kind, []).append(provided)
        self._load_errors: dict[str, str] = {}
        self._opt_in = frozenset(name for name, provided in kinds.items() if provided.kind.opt_in)
        # Kernels this mode leaves to torch.compile where they would be chosen (KernelSpec.native_when_compiled).
        self._compiled = frozenset(p.spec.id for p in kernels if p.spec.left_to_compiler(mode))

    def kernels_for(self, kind: str) -> list[ProvidedKernel]:
        return self._by_kind.get(kind, [])

    def _config_block(self, provided: ProvidedKernel, kind: str) -> str | None:
        spec, plugin = provided.spec, provided.plugin.name
        if spec.id in self.config.disabled_kernels:
            return f"disabled by config (kernels.disable lists {spec.id})"
        kind_disable = self.config.kind(kind).disable
        if spec.id in kind_disable or plugin in kind_disable:
            return f"disabled by config (kinds.{kind}.disable lists {spec.id if spec.id in kind_disable else plugin})"
        if plugin in self.config.block_plugins:
            return f"disabled by config (plugins.block lists {plugin})"
        if self.config.allow_plugins is not None and plugin not in self.config.allow_plugins:
            return f"disabled by config (plugin {plugin} not in plugins.allow)"
        return None

    def problem(self, provided: ProvidedKernel, match: Match, target: Target) -> str | None:
        """Why this kernel cannot serve this module, or None if it can."""
        spec = provided.spec
        blocked = self._config_block(provided, match.kind)
        if blocked:
            return blocked
        if not spec.portable and spec.backend != target.backend:
            return f"runs on backend {spec.backend}, module is on {target.backend or target.device}"
        if match.variant not in spec.variants:
            return f"variant unsupported: handles {list(spec.variants)}, module is {match.variant}"
        if Mode.TRAINING in self.mode and Supports.BACKWARD not in spec.supports:
            return "mode unsupported: inference-only kernel (no backward), mode is TRAINING"
        if Mode.TORCH_COMPILE in self.mode and Supports.TORCH_COMPILE not in spec.supports:
            return "mode unsupported: not declared torch.compile-safe, mode includes TORCH_COMPILE"
        if spec.compile_only and Mode.TORCH_COMPILE not in self.mode:
            return (f"mode unsupported: runs only under torch.compile (eagerly it is slower than what it replaces); "
                    f"mode is {self.mode.name}, add Mode.TORCH_COMPILE")
        if target.dtype is not None and target.dtype not in spec.dtypes:
            return f"dtype unsupported: handles {list(spec.dtypes)}, module is {target.dtype}"
        info = target.device_info
        if spec.capability is not None and not spec.portable:
            if info is None or info.capability is None:
                return "capability out of range: device reports no compute capability"
            if not spec.capability.contains(info.capability):
                cap = f"{info.capability[0]}.{info.capability[1]}"
                return f"capability out of range: device is {cap}, kernel needs {spec.capability}"
        if spec.archs and not spec.portable and (info is None or info.arch not in spec.archs):
            arch = info.arch if info else None
            return f"architecture unsupported: device is {arch}, kernel needs {list(spec.archs)}"
        for requirement in spec.requires:
            missing = requirement_problem(requirement)
            if missing:
                return missing
        return None

    def load_problem(self, provided: ProvidedKernel) -> str | None:
        """Why this kernel's implementation cannot be loaded, or None; a failure warns once per kernel and process.

        Called only for a kernel that qualified for a module, so a failure here means the choice falls back.
        """
        spec = provided.spec
        if spec.id not in self._load_errors:
            try:
                impl = load_ref(spec.impl)
                self._load_errors[spec.id] = "" if callable(impl) else f"failed to load: {spec.impl} is not callable"
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot load falls back
                self._load_errors[spec.id] = f"failed to load {spec.impl}: {type(exc).__name__}: {exc}"
            if self._load_errors[spec.id]:
                note_fallback(provided, self._load_errors[spec.id])
        return self._load_errors[spec.id] or None

    def choose(self, match: Match, target: Target, *,
               verify: Callable[[ProvidedKernel], str | None] | None = None) -> Choice:
        """The kernel for one module, or why none; ``verify`` is a last check of a kernel that qualifies (its
        adapter builds for the module and its output fits), returning why it cannot serve it after all."""
        kind_config = self.config.kind(match.kind)
        if not kind_config.enabled:
            return Choice(None, reason=f"disabled by config (kinds.{match.kind}.enabled = false)")
        candidates = self.kernels_for(match.kind)
        preferred = kind_config.prefer.get(target.backend or "", ()) or kind_config.prefer.get("any", ())
        if preferred:
            return self._choose_preferred(match, target, preferred, candidates, verify)
        if match.kind in self._opt_in:
            # Requested for other backends only: an opt-in kind's kernels are never chosen automatically.
            return Choice(None, reason=f"opt-in kind: kinds.{match.kind}.prefer names no kernel for backend "
                                       f"{target.backend or target.device} (nor for 'any')")
        problems: list[str] = []
        for provided in candidates:
            problem = self.problem(provided, match, target)
            if problem is None and provided.spec.id in self._compiled:
                kernel_id = provided.spec.id
                return Choice(None, reason=f"left to torch.compile: {kernel_id}, the best kernel here, runs plain "
                                           f"PyTorch ops when traced in {self.mode.name}, so Inductor compiles the "
                                           "module's own forward (binding it would only add guards)",
                              left_to_compiler=kernel_id)
            problem = problem or self.load_problem(provided)
            if problem is None and verify is not None:
                problem = verify(provided)
            if problem is None:
                # Say why any better-ranked kernel meant for this module was passed over: not one for another
                # backend or another variant of the kind, nor one the configuration turned off.
                passed_over = [text for p, text in zip(candidates, problems, strict=False)
                               if self._serves_backend(p, target) and match.variant in p.spec.variants
                               and self._config_block(p, match.kind) is None]
                note = f"fell back: {'; '.join(passed_over)}" if passed_over else None
                return Choice(provided, note=note)
            problems.append(f"{provided.spec.id}: {problem}")
        unmet = any(self._serves_backend(p, target) and self._config_block(p, match.kind) is None for p in candidates)
        return Choice(None, reason=self._summarise(match, target, candidates, problems), unmet=unmet)

    @staticmethod
    def _serves_backend(provided: ProvidedKernel, target: Target) -> bool:
        return provided.spec.portable or provided.spec.backend == target.backend

    def _summarise(self, match: Match, target: Target, candidates: list[ProvidedKernel], problems: list[str]) -> str:
        if not any(self._serves_backend(p, target) for p in candidates):
            return f"no kernel for backend {target.backend or target.device} (kind {match.kind})"
        # One problem per candidate, in order: only those meant for this backend explain the outcome.
        return "; ".join(text for p, text in zip(candidates, problems, strict=True) if self._serves_backend(p, target))

    def _choose_preferred(self, match: Match, target: Target, preferred: tuple[str, ...],
                          candidates: list[ProvidedKernel],
                          verify: Callable[[ProvidedKernel], str | None] | None) -> Choice:
        by_id = {p.spec.id: p for p in candidates}
        why: list[str] = []
        for kernel_id in preferred:
            provided = by_id.get(kernel_id)
            if provided is None:
                why.append(f"{kernel_id}: no such kernel for kind {match.kind}")
                continue
            problem = self.problem(provided, match, target) or self.load_problem(provided)
            if problem is None and verify is not None:
                problem = verify(provided)
            if problem is None:
                return Choice(provided, note="preferred by config")
            why.append(f"{kernel_id}: {problem}")
        usable = [p.spec.id for p in candidates
                  if self.problem(p, match, target) is None and self.load_problem(p) is None]
        key = target.backend if self.config.kind(match.kind).prefer.get(target.backend or "") else "any"
        raise KernelizeError(
            f"configured kernels for kind {match.kind!r} on backend {target.backend!r} cannot be used: "
            f"{'; '.join(why)}. Kernels that would work here: {usable or 'none'}; "
            f"all kernels of this kind: {sorted(by_id) or 'none'} "
            f"(kinds.{match.kind}.prefer.{key} set in {self.config.origin('kinds', match.kind, 'prefer', str(key))})"
        )


class Assignments:
    """The kernels given to each module so far, and each module's complete plan at the end (:meth:`plans`).

    One forward per module: a kernel of a forward kind and kernels of global kinds (rerouting globals of its class
    forward) cannot share it, nor can two global kernels reroute one global unless the later one's kind builds on
    the earlier (its adapter takes ``base``).
    """

    def __init__(self) -> None:
        self._drafts: dict[int, _Draft] = {}

    def add(self, name: str, module: nn.Module, planned: PlannedKernel, built: Any) -> str | None:
        """Assign ``planned`` (with what its kind's adapter built) to ``module``; or, where the module's forward is
        taken, the kernel that took it."""
        return self._drafts.setdefault(id(module), _Draft(name, module)).add(planned, built)

    def plans(self, *, device_checked: bool) -> tuple[ForwardPlan, ...]:
        """Every module's complete plan (see :meth:`_Draft.finished`)."""
        return tuple(draft.finished(device_checked=device_checked) for draft in self._drafts.values())


@dataclass
class _Draft:
    """One module's kernels while planning goes on: one of a forward kind (with what its adapter built), or those
    of global kinds."""

    name: str
    module: nn.Module
    forward: PlannedKernel | None = None
    built: Any = None
    globals: list[PlannedKernel] = field(default_factory=list)

    def add(self, planned: PlannedKernel, built: Any) -> str | None:
        """Add ``planned``; or, where the module's forward is taken, the kernel that took it."""
        if self.forward is not None:
            return self.forward.kernel.spec.id
        if planned.kind.kind.target == "forward":
            if self.globals:
                return self.globals[0].kernel.spec.id
            self.forward, self.built = planned, built
            return None
        clash = _global_clash(self.globals, planned)
        if clash is None:
            self.globals.append(planned)
        return clash

    def finished(self, *, device_checked: bool) -> ForwardPlan:
        """The module's complete plan. Each call of its forward checks the probe parameter's dtype, and its device
        type where each module's own device decided the kernels: kernelize told the device the model will run on
        binds kernels for that device before the model is there. Without a floating-point parameter, nothing."""
        kernels = (self.forward,) if self.forward is not None else tuple(self.globals)
        probe = probe_parameter(self.module)
        device_type = probe[2].device.type if probe is not None and device_checked else None
        return ForwardPlan(self.name, self.module, kernels, guards=tuple(p.declared(device_type) for p in kernels),
                           probe=probe[:2] if probe is not None else None, built=self.built)


def _global_clash(planned: list[PlannedKernel], new: PlannedKernel) -> str | None:
    """The kernel already rerouting the same global in this module's forward that ``new``'s kind cannot build on."""
    if takes_base(load_ref(new.kind.kind.adapter)):
        return None
    name = new.match.params.get("global_name")
    return next((p.kernel.spec.id for p in planned if p.match.params.get("global_name") == name
                 and not takes_base(load_ref(p.kind.kind.adapter))), None)
