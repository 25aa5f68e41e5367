"""What kernelize did, module by module, printable as a table and as JSON; and that report as the model is now
(:func:`as_now`): a kernel that no longer runs where kernelize bound it shows as fallen back."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import asdict
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

from ._binding import record_of
from ._binding import stored_report
from ._forward import forwards_in
from .persisted import Persisted


if TYPE_CHECKING:
    from torch import nn

__all__ = ["KernelizeReport", "ReportEntry", "as_now", "format_table"]


@dataclass(frozen=True)
class ReportEntry(Persisted):
    """One matched module and layer kind: the kernel applied, or why none was.

    ``reason`` is set when nothing was applied; ``note`` says why an applied kernel is not the first choice
    (a preferred or higher-priority kernel could not be used). ``covered_by`` and ``covered_on`` are set when
    a kernel bound to an enclosing module (``covered_on``) computes this module's math itself, so this module's
    forward never runs: it gets no kernel of its own and is not counted as a binding. ``left_to_compiler`` names
    the kernel that would have run where the module was left on its own forward for torch.compile, since that
    kernel traces to the same plain PyTorch ops (``KernelSpec.native_when_compiled``).

    ``fell_back`` names a kernel kernelize bound that does not run now, as :func:`~kernels_core.get_report` finds
    the model when it is asked: the module's parameters were converted since to a dtype the kernel does not declare
    (``model.double()``, ``.half()``, ``.to(dtype)``) or moved to another device type (``.cpu()``), so each call
    runs the module's own forward, or the binding was removed (``unkernelize`` of a part of the model). For a
    covered module it names the enclosing module's kernel, whose fallback runs this module's own forward again.
    ``reason`` says which.
    """

    module: str
    kind: str
    variant: str | None
    device: str | None
    backend: str | None
    kernel: str | None = None
    plugin: str | None = None
    distribution: str | None = None
    version: str | None = None
    reason: str | None = None
    note: str | None = None
    covered_by: str | None = None
    covered_on: str | None = None
    left_to_compiler: str | None = None
    fell_back: str | None = None

    @property
    def applied(self) -> bool:
        return self.kernel is not None

    @property
    def covered(self) -> bool:
        return self.covered_by is not None and self.fell_back is None


@dataclass(frozen=True)
class KernelizeReport(Persisted):
    """The outcome of one kernelize call.

    Example:
        >>> report = KernelizeReport(mode="TRAINING", entries=())
        >>> report.summary()
        'kernelize (TRAINING): 0 of 0 matched modules got a kernel'
    """

    mode: str
    entries: tuple[ReportEntry, ...]
    disabled: str | None = None
    config_sources: tuple[str, ...] = ()

    @property
    def applied(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.applied)

    @property
    def covered(self) -> tuple[ReportEntry, ...]:
        """Matched modules whose math a kernel on an enclosing module computes (their forward never runs)."""
        return tuple(e for e in self.entries if e.covered)

    @property
    def skipped(self) -> tuple[ReportEntry, ...]:
        """Matched modules that run their own forward without a kernel."""
        return tuple(e for e in self.entries if not e.applied and not e.covered)

    def summary(self) -> str:
        """One line: how many matched modules run a kernel, and each kernel with the number of modules it runs on."""
        if self.disabled:
            return f"kernelize ({self.mode}): disabled, no kernel applied ({self.disabled})"
        by_kernel = Counter(e.kernel for e in self.applied)
        parts = ", ".join(f"{kernel} x{count}" for kernel, count in sorted(by_kernel.items()))
        # A row for a whole layer kind (its matcher or adapter does not load, or raised) matched no module.
        matched = sum(1 for e in self.entries if e.module or e.variant or e.device or e.backend)
        text = f"kernelize ({self.mode}): {len(self.applied)} of {matched} matched modules got a kernel"
        covered = len(self.covered)
        if covered:
            text += f", {covered} computed by a kernel on an enclosing module"
        compiled = sum(1 for e in self.entries if e.left_to_compiler)
        if compiled:
            text += f", {compiled} left to torch.compile"
        fell_back = sum(1 for e in self.entries if e.fell_back)
        if fell_back:
            text += f", {fell_back} fell back to their own forward since kernelize"
        return f"{text} [{parts}]" if parts else text

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "disabled": self.disabled,
            "config_sources": list(self.config_sources),
            "summary": self.summary(),
            "entries": [asdict(e) for e in self.entries],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, *, collapse: bool = True) -> str:
        """A fixed-width table; with ``collapse``, identical rows of numbered layers are merged (``layers.*``)."""
        rows = []
        for e in self.entries:
            outcome = e.kernel if e.applied else "-"
            origin = f"{e.distribution} {e.version}" if e.distribution else (e.plugin or "")
            if e.covered:
                why = f"covered by {e.covered_by} on {e.covered_on or '(model)'}"
            else:
                why = e.note or "" if e.applied else e.reason or ""
            rows.append((e.module or "(model)", e.kind, e.variant or "-", e.backend or "-", outcome, origin, why))
        if collapse:
            rows = _collapse(rows)
        header = ("module", "kind", "variant", "backend", "kernel", "from", "note / reason")
        lines = [self.summary()]
        if rows:
            lines.append(format_table(header, rows))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _collapse(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Merge rows that differ only by layer numbers in the module path (and in the path of the enclosing module
    that covers them), counting them."""
    import re

    def numbered(path: str) -> str:
        return re.sub(r"(?<=[A-Za-z_])\.\d+(?=\.|$)", ".*", path)

    grouped: dict[tuple[str, ...], int] = {}
    order: list[tuple[str, ...]] = []
    for row in rows:
        why = row[-1]
        if why.startswith("covered by "):
            why = numbered(why)
        key = (numbered(row[0]), *row[1:-1], why)
        if key not in grouped:
            order.append(key)
            grouped[key] = 0
        grouped[key] += 1
    return [(f"{k[0]} (x{grouped[k]})" if grouped[k] > 1 else k[0], *k[1:]) for k in order]


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(v)) for v in column) for column in zip(header, *rows, strict=True)]
    def line(values: tuple[str, ...]) -> str:
        return "  ".join(str(v).ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])


def as_now(model: nn.Module) -> KernelizeReport | None:
    """The report of the last kernelize call on ``model`` with every kernel that does not run now where it was bound
    shown as fallen back (see :func:`kernels_core.get_report`); None if it was never kernelized or was restored."""
    report = stored_report(model)
    if report is None or report.disabled:
        return report
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


def _binding_state(model: nn.Module, name: str) -> tuple[str | None, set[str], dict[str, str]]:
    """For module ``name``: why none of its kernels runs (or None), the kernels bound to it, why each does not run."""
    from torch import nn

    try:
        module = model.get_submodule(name)
    except AttributeError:
        return "the module is no longer in the model", set(), {}
    # torch.compile(module) put in its place (each decoder layer compiled, as FSDP2 recipes do) calls the module it
    # wraps, ``_orig_mod``, whose binding then runs.
    while record_of(module) is None and isinstance(module._modules.get("_orig_mod"), nn.Module):
        module = module._modules["_orig_mod"]
    record = record_of(module)
    if record is None:
        return ("its binding was removed since kernelize (unkernelize of a part of the model, or a copy of that "
                "part)"), set(), {}
    forwards = forwards_in(record)
    # A plugin's own binding holds other objects: its kernels run as bound.
    failing = forwards[0].runtime_problems() if len(forwards) == 1 else []
    then = ("each call raises KernelizeError, since configuration prefers it" if any(d.preferred for d, _ in failing)
            else "the module's own forward runs instead")
    problems = {declared.kernel_id: f"{cause}; {then}" for declared, cause in failing}
    bound = {kernel_id for _, kernel_id in record.kernels}
    for kernel_id in bound - set(problems):
        if failing:
            # One rerouted forward: where one of its kernels cannot run, the class forward runs without any.
            problems[kernel_id] = f"another kernel of the same forward cannot run ({failing[0][1]}); {then}"
    return None, bound, problems
