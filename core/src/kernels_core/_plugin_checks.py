"""Checks across plugins after each has been collected: kind ownership, unknown kinds and variants, id clashes.

A kernel of a kind its plugin does not own is checked against the owner's declaration: an unknown variant drops
that kernel alone, with the allowed variants named; a second declaration of a kernel id or layer kind is a
conflict, listed by ``kernels-core plugins``.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable

from ._plugin_info import ENV_STRICT
from ._plugin_info import Contribution
from ._plugin_info import PluginError
from ._plugin_info import PluginInfo
from ._plugin_info import replace_info
from ._types import KernelSpec
from ._types import LayerKind


__all__ = ["CrossPluginChecks"]

logger = logging.getLogger("kernels_core._manager")


class CrossPluginChecks:
    """Mixin of :class:`~kernels_core.KernelsPluginManager`: the checks that need every plugin's declarations."""

    _infos: dict[str, PluginInfo]
    _rejected: list[tuple[KernelSpec, PluginInfo, str]]
    strict: bool
    # Both defined by the manager: record a load-time clash; note a problem that does not stop a loaded plugin.
    _note_conflict: Callable[[str], None]
    _soft_problem: Callable[[str, str], None]
    def _validate_cross_plugin(self, contributions: dict[str, Contribution]) -> None:
        kind_names = {k.name for c in contributions.values() for k in c.kinds}
        for name in sorted(contributions):
            bad = [s.id for s in contributions[name].kernels if s.kind not in kind_names]
            if bad:
                reason = f"kernels {bad} name unknown layer kinds; known kinds: {sorted(kind_names)}"
                self._infos[name] = replace_info(self._infos[name], status="skipped", reason=reason)
                message = f"kernels-core plugin {name!r} ({self._infos[name].origin}) skipped: {reason}"
                if self.strict:
                    raise PluginError(name, message)
                logger.warning("%s (set %s=1 to raise instead)", message, ENV_STRICT)
                del contributions[name]
        # A layer kind has one owner: the core's own kinds always win; between two plugins the one sorting
        # first keeps it and the other plugin is skipped whole, since its kernels follow another calling
        # convention than the kept kind's adapter would use.
        owners: dict[str, str] = {}
        for name in sorted(contributions, key=lambda n: (n != "builtin", n)):
            for kind in contributions[name].kinds:
                owner = owners.setdefault(kind.name, name)
                if owner != name:
                    reason = (f"declares layer kind {kind.name!r}, already declared by plugin {owner!r}; "
                              "rename the kind")
                    self._infos[name] = replace_info(self._infos[name], status="skipped", reason=reason)
                    message = f"kernels-core plugin {name!r} ({self._infos[name].origin}) skipped: {reason}"
                    self._note_conflict(message)
                    if self.strict:
                        raise PluginError(name, message)
                    del contributions[name]
                    break
        seen_ids: dict[str, str] = {}
        seen_kinds: dict[str, str] = {}
        seen_priority: dict[tuple[str, str, int], str] = {}
        kinds: dict[str, tuple[LayerKind, str]] = {}
        for name in sorted(contributions, key=lambda n: (n != "builtin", n)):
            for k in contributions[name].kinds:
                kinds.setdefault(k.name, (k, name))
        for name in sorted(contributions):
            for kind in contributions[name].kinds:
                if kind.name in seen_kinds:
                    self._note_conflict(
                        f"layer kind {kind.name!r} declared by {seen_kinds[kind.name]!r} and {name!r}; "
                        f"using {seen_kinds[kind.name]!r}'s"
                    )
                else:
                    seen_kinds[kind.name] = name
            kept = []
            for spec in contributions[name].kernels:
                if spec.kind not in kinds:  # its kind's plugin was skipped above
                    self._reject(name, spec, f"layer kind {spec.kind!r} is declared by no loaded plugin; "
                                             f"known kinds: {sorted(kinds)}")
                    continue
                kind, kind_owner = kinds[spec.kind]
                unknown = [v for v in spec.variants if v not in kind.variants]
                if unknown:
                    self._reject(name, spec, _variant_problem(spec, unknown, kind, kind_owner))
                    continue
                if spec.id in seen_ids:
                    self._note_conflict(
                        f"kernel id {spec.id!r} declared by {seen_ids[spec.id]!r} and {name!r}; "
                        f"using {seen_ids[spec.id]!r}'s"
                    )
                    continue
                seen_ids[spec.id] = name
                key = (spec.kind, spec.backend, spec.priority)
                if key in seen_priority and seen_priority[key] != name:
                    self._note_conflict(
                        f"plugins {seen_priority[key]!r} and {name!r} both declare priority {spec.priority} for "
                        f"kind {spec.kind!r} on backend {spec.backend!r}; ties break by plugin name, then kernel id"
                    )
                seen_priority.setdefault(key, name)
                kept.append(spec)
            contributions[name].kernels = kept
            contributions[name].kinds = [k for k in contributions[name].kinds if seen_kinds[k.name] == name]

    def _reject(self, name: str, spec: KernelSpec, reason: str) -> None:
        """Drop one kernel of a loaded plugin (its other kernels stay): listed, warned once, raised if strict."""
        self._rejected.append((spec, self._infos[name], reason))
        self._soft_problem(name, f"kernel {spec.id!r} ignored: {reason}")


def _variant_problem(spec: KernelSpec, unknown: list[str], kind: LayerKind, owner: str) -> str:
    hints = [f"{v!r} -> {close[0]!r}?" for v in unknown if (close := difflib.get_close_matches(v, kind.variants, 1))]
    hint = f" (did you mean {', '.join(hints)})" if hints else ""
    return (f"declares variant(s) {unknown} that layer kind {spec.kind!r} (plugin {owner!r}) does not have{hint}; "
            f"allowed variants: {sorted(kind.variants)}. Fix the kernel's variants in kernels_core_kernels()")
