"""Checks across plugins, once each has declared what it offers: kind ownership, unknown kinds and variants, clashes.

:func:`cross_check` is a pure function of every loaded plugin's declarations: it returns what to keep and what it
found, and the plugin manager applies that (statuses, warnings, listings, strict mode). A kernel of a kind its
plugin does not own is checked against the owner's declaration: an unknown variant drops that kernel alone, with
the allowed variants named; a malformed ``KernelSpec`` drops that kernel alone, naming the field. A second
declaration of a layer kind skips the later plugin whole. A kernel id declared by several plugins goes to the
declaration with the highest priority, the others rejected (all of them on a tie), told to every declaring plugin;
one priority declared twice for one kind and backend is a conflict. Conflicts are listed by ``kernels-core plugins``.

Example:
    >>> from kernels_core._plugins._records import Contribution
    >>> found = cross_check({"builtin": Contribution()})
    >>> found.skipped, found.conflicts, found.rejected
    ([], [], [])
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

from .._types import KernelSpec
from .._types import LayerKind
from .._types import declaration_problem
from ._records import Contribution


__all__ = ["Findings", "Skip", "cross_check"]

logger = logging.getLogger("kernels_core")


@dataclass(frozen=True)
class Skip:
    """A plugin to skip whole, and why; ``clash``: it redeclares another plugin's layer kind (also a conflict)."""

    plugin: str
    reason: str
    clash: bool = False


@dataclass
class Findings:
    """What :func:`cross_check` keeps, in the order it found things: skipped plugins, conflicts, rejected kernels."""

    kept: dict[str, Contribution]
    skipped: list[Skip] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    rejected: list[tuple[str, KernelSpec, str]] = field(default_factory=list)


def _core_first(names: Iterable[str]) -> list[str]:
    # The core's own kinds always win; between two plugins, the one whose name sorts first.
    return sorted(names, key=lambda name: (name != "builtin", name))


def cross_check(contributions: Mapping[str, Contribution]) -> Findings:
    """Check every plugin's declarations against the others'; ``contributions`` is left as it is."""
    found = Findings({name: replace(c, kinds=list(c.kinds), kernels=list(c.kernels))
                      for name, c in sorted(contributions.items())})
    kept = found.kept
    for name, contribution in kept.items():
        # A KernelSpec its plugin built with a wrong field (marked under kernels_core._types.declaring): that kernel
        # alone is rejected, naming the field; the plugin's other kernels stay.
        valid = []
        for spec in contribution.kernels:
            problem = declaration_problem(spec)
            if problem is None:
                valid.append(spec)
            else:
                found.rejected.append((name, spec, f"{problem}. Fix the KernelSpec in kernels_core_kernels()"))
        contribution.kernels = valid
    kind_names = {k.name for c in kept.values() for k in c.kinds}
    for name in list(kept):
        bad = [s.id for s in kept[name].kernels if s.kind not in kind_names]
        if bad:
            found.skipped.append(Skip(name, f"kernels {bad} name unknown layer kinds; known kinds: "
                                            f"{sorted(kind_names)}"))
            del kept[name]
    # A second plugin declaring a kind is skipped whole: its kernels follow another calling convention than the
    # kept kind's adapter would use.
    kinds: dict[str, tuple[LayerKind, str]] = {}
    for name in _core_first(kept):
        clash = next((k.name for k in kept[name].kinds if kinds.get(k.name, (None, name))[1] != name), None)
        if clash is not None:
            found.skipped.append(Skip(name, f"declares layer kind {clash!r}, already declared by plugin "
                                            f"{kinds[clash][1]!r}; rename the kind", clash=True))
            del kept[name]
            continue
        unique: list[LayerKind] = []
        for kind in kept[name].kinds:
            if kind.name in kinds:
                found.conflicts.append(f"layer kind {kind.name!r} declared twice by {name!r}; using the first")
                continue
            kinds[kind.name] = (kind, name)
            unique.append(kind)
        kept[name].kinds = unique
    winners = _id_winners(kept, kinds)
    seen_priority: dict[tuple[str, str, int], str] = {}
    for name, contribution in kept.items():
        kernels: list[KernelSpec] = []
        for spec in contribution.kernels:
            if any(spec.id == other.id for other in kernels):
                found.conflicts.append(f"kernel id {spec.id!r} declared twice by {name!r}; using the first")
                continue
            if spec.kind not in kinds:  # the plugin declaring its kind was skipped above
                found.rejected.append((name, spec, f"layer kind {spec.kind!r} is declared by no loaded plugin; "
                                                   f"known kinds: {sorted(kinds)}"))
                continue
            kind, owner = kinds[spec.kind]
            unknown = [v for v in spec.variants if v not in kind.variants]
            if unknown:
                found.rejected.append((name, spec, _variant_problem(spec, unknown, kind, owner)))
                continue
            rivals = winners.get(spec.id)
            if rivals is not None:
                winner, others = rivals
                if winner != name:
                    found.rejected.append((name, spec, _id_problem(spec, name, others, winner)))
                    continue
                # The winner's author hears of the clash too: the other plugin's users lose that kernel.
                found.conflicts.append(_id_problem(spec, name, others, winner))
            key = (spec.kind, spec.backend, spec.priority)
            if seen_priority.setdefault(key, name) != name:
                found.conflicts.append(
                    f"plugins {seen_priority[key]!r} and {name!r} both declare priority {spec.priority} for kind "
                    f"{spec.kind!r} on backend {spec.backend!r}; ties break by plugin name, then kernel id")
            kernels.append(spec)
        contribution.kernels = kernels
    logger.debug("cross-plugin check: kept %s, skipped %s, %d conflict(s), %d kernel(s) rejected", sorted(kept),
                 [s.plugin for s in found.skipped], len(found.conflicts), len(found.rejected))
    return found


def _id_winners(kept: Mapping[str, Contribution], kinds: Mapping[str, object]
                ) -> dict[str, tuple[str | None, dict[str, int]]]:
    """Kernel ids declared by more than one plugin: id -> (the plugin whose declaration has the highest priority, or
    None on a tie, which refuses them all; every declaring plugin with its priority)."""
    declared: dict[str, dict[str, int]] = {}
    for name, contribution in kept.items():
        for spec in contribution.kernels:
            if spec.kind in kinds:
                declared.setdefault(spec.id, {}).setdefault(name, spec.priority)
    winners: dict[str, tuple[str | None, dict[str, int]]] = {}
    for kernel_id, plugins in declared.items():
        if len(plugins) < 2:
            continue
        top = max(plugins.values())
        best = [name for name, priority in plugins.items() if priority == top]
        winners[kernel_id] = (best[0] if len(best) == 1 else None, plugins)
    return winners


def _id_problem(spec: KernelSpec, name: str, plugins: Mapping[str, int], winner: str | None) -> str:
    declared = ", ".join(f"{plugin!r} (priority {priority})" for plugin, priority in sorted(plugins.items()))
    fix = ("Kernel ids are global: rename the kernel (conventionally <backend>.<kind>.<name>, with the plugin's name "
           "in it)")
    if winner is None:
        return f"kernel id {spec.id!r} is declared by plugins {declared} with equal priority, so none is used. {fix}"
    if winner == name:
        return (f"kernel id {spec.id!r} is declared by plugins {declared}; {winner!r}'s (the highest priority) is "
                f"used, the others are rejected. {fix}")
    return (f"kernel id {spec.id!r} is declared by plugins {declared}; {winner!r}'s (the highest priority) is used "
            f"instead of this one. {fix}")


def _variant_problem(spec: KernelSpec, unknown: list[str], kind: LayerKind, owner: str) -> str:
    hints = [f"{v!r} -> {close[0]!r}?" for v in unknown if (close := difflib.get_close_matches(v, kind.variants, 1))]
    hint = f" (did you mean {', '.join(hints)})" if hints else ""
    return (f"declares variant(s) {unknown} that layer kind {spec.kind!r} (plugin {owner!r}) does not have{hint}; "
            f"allowed variants: {sorted(kind.variants)}. Fix the kernel's variants in kernels_core_kernels()")
