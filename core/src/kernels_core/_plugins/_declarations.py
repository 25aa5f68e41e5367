"""What the loaded plugins declare, as kernelize and the listings query it: backends, layer kinds and kernels, each
with the plugin that declared it; and what collecting them dropped or found clashing.

:class:`~._loading.PluginLoader` collects one :class:`Declarations` through the plugins' hooks and checks it across
plugins (:mod:`._cross_check`); nothing here calls a plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from .._types import ANY_BACKEND
from .._types import BackendInfo
from .._types import KernelSpec
from ._records import Contribution
from ._records import PluginInfo
from ._records import ProvidedKernel
from ._records import ProvidedKind


__all__ = ["Declarations"]


@dataclass
class Declarations:
    """One collection of every loaded plugin's declarations (``contributions``, by plugin name), with the plugins'
    records (``infos``), and its findings: name clashes (``conflicts``), problems that did not stop a plugin
    (``soft_problems``, by plugin) and kernels dropped from loaded plugins with the reason (``rejected``)."""

    infos: dict[str, PluginInfo]
    contributions: dict[str, Contribution] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    soft_problems: dict[str, list[str]] = field(default_factory=dict)
    rejected: list[tuple[KernelSpec, PluginInfo, str]] = field(default_factory=list)

    def backends(self) -> list[tuple[BackendInfo, PluginInfo]]:
        """Detected backends, highest priority first; ties break by backend name."""
        pairs = [(b, self.infos[name]) for name, c in self.contributions.items() for b in c.backends]
        return sorted(pairs, key=lambda pair: (-pair[0].priority, pair[0].backend))

    def layer_kinds(self) -> dict[str, ProvidedKind]:
        return {k.name: ProvidedKind(k, self.infos[name]) for name, c in self.contributions.items() for k in c.kinds}

    def kernels(self) -> list[ProvidedKernel]:
        """Declared kernels, in a deterministic order: kind, then priority (high first), plugin, id."""
        provided = [ProvidedKernel(s, self.infos[name]) for name, c in self.contributions.items() for s in c.kernels]
        return sorted(provided, key=lambda p: (p.spec.kind, -p.spec.priority, p.plugin.name, p.spec.id))

    def detectable_backends(self) -> frozenset[str]:
        """Backend names some loaded plugin's detect hook reports, with or without devices, plus ``any``."""
        return frozenset({b.backend for b, _ in self.backends()} | {ANY_BACKEND})

    def plugin_problems(self, name: str) -> list[str]:
        """Problems of loaded plugin ``name`` that did not stop it and concern no single kernel (a hook returning
        None, an unknown ``KERNELS_CORE_*`` attribute)."""
        rejected = {f"kernel {spec.id!r} ignored: {reason}" for spec, info, reason in self.rejected
                    if info.name == name}
        return [problem for problem in self.soft_problems.get(name, []) if problem not in rejected]
