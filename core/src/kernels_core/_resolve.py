"""Choosing a kernel for one matched module, or saying exactly why none fits; and whether a kernel can run on this
machine at all (:func:`runnable_here`, for listings and checks).

Priority is data: qualifying kernels sort by (priority high first, plugin name, kernel id), so the outcome never
depends on the order plugins were registered in. Configured preferences come first and raise when they
cannot be honoured; automatic choices fall back to the next candidate and record why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING
from typing import Any

from ._config import KernelsConfig
from ._plugin_info import ProvidedKernel
from ._refs import load_ref
from ._types import BackendInfo
from ._types import DeviceInfo
from ._types import Match
from ._types import Mode
from ._types import Supports
from ._types import device_name


if TYPE_CHECKING:
    from ._manager import KernelsPluginManager

__all__ = ["Choice", "KernelizeError", "Resolver", "Target", "runnable_here"]

logger = logging.getLogger("kernels_core")  # the package's one logger


class KernelizeError(RuntimeError):
    """kernelize could not honour an explicit request; the model was left exactly as it was."""


@dataclass(frozen=True)
class Target:
    """Where a matched module runs: its device, the backend that drives it, and that device's properties."""

    device: str | None
    backend: str | None
    device_info: DeviceInfo | None
    dtype: str | None


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


@cache
def _requirement_problem(requirement: str) -> str | None:
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


class Resolver:
    """Kernel choice for one kernelize call (one mode, one configuration, one plugin manager)."""

    def __init__(self, pm: KernelsPluginManager, config: KernelsConfig, mode: Mode) -> None:
        self.pm = pm
        self.config = config
        self.mode = mode
        self._by_kind: dict[str, list[ProvidedKernel]] = {}
        for provided in pm.kernels():
            self._by_kind.setdefault(provided.spec.kind, []).append(provided)
        self._load_errors: dict[str, str] = {}
        self._opt_in = frozenset(name for name, provided in pm.layer_kinds().items() if provided.kind.opt_in)

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
            missing = _requirement_problem(requirement)
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
                self.pm.note_fallback(provided, self._load_errors[spec.id])
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
            if problem is None and provided.spec.left_to_compiler(self.mode):
                kernel_id = provided.spec.id
                return Choice(None, reason=f"left to torch.compile: {kernel_id}, the best kernel here, runs plain "
                                           f"PyTorch ops when traced in {self.mode.name}, so Inductor compiles the "
                                           "module's own forward (binding it would only add guards)",
                              left_to_compiler=kernel_id)
            problem = problem or self.load_problem(provided)
            if problem is None and verify is not None:
                problem = verify(provided)
            if problem is None:
                # Say why any better-ranked kernel meant for this device was passed over.
                passed_over = [p for p in problems if "runs on backend" not in p and "disabled by config" not in p]
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
        problem = _requirement_problem(requirement)
        if problem:
            return None, None, problem
    return name, device, ""
