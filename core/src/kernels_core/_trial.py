"""Trying a kernel on its module before kernelize binds it: the kind's adapter builds, and what it built fits.

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
not import: the next candidate runs, or the module keeps its own forward. Each such piece of broken plugin code is
recorded in the call's :class:`~kernels_core._plugins._diagnostics.PluginFaults`, which warns about it once per
kernelize call (and once per process and cause); strict kernelize raises for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._forward import tensors_in
from ._kinds._context import MatchContext
from ._kinds._context import Probe
from ._kinds._context import ProbeRandomness
from ._kinds._context import probe_behaviour
from ._kinds._zero3 import is_partitioned
from ._plugins._diagnostics import PluginFaults
from ._plugins._diagnostics import where
from ._plugins._records import ProvidedKernel
from ._plugins._records import ProvidedKind
from ._refs import load_ref
from ._types import Match


__all__ = ["KernelTrials", "output_problem"]

logger = logging.getLogger("kernels_core")


class KernelTrials:
    """The trials of one kernelize call: adapters build, outputs fit; results shared by modules of one probe."""

    def __init__(self, ctx: MatchContext, faults: PluginFaults) -> None:
        self.ctx = ctx
        self.faults = faults
        # (id(probe), kernel id) -> problem or None: layers sharing one probe (one piece of math) share the result.
        self._outputs: dict[tuple[int, str], str | None] = {}

    def run(self, module: nn.Module, name: str, kind: ProvidedKind, match: Match, kernel: ProvidedKernel,
            options: dict[str, object]) -> tuple[Any, str | None]:
        """(what the kind's adapter builds for this module and kernel, or None; why the kernel cannot serve it)."""
        try:
            built = load_ref(kind.kind.adapter)(module, match, load_ref(kernel.spec.impl), dict(options))
        except Exception as exc:  # noqa: BLE001 - a broken adapter declines, the other kinds and kernels go on
            cause = f"{type(exc).__name__}: {exc}"
            self.faults.adapter_raised(kind, kernel, where(name, module), cause, exc)
            return None, f"the adapter {kind.kind.adapter} of plugin {kind.plugin.name!r} raised {cause}"
        probe = self.ctx.probe_of(module, match)
        if probe is None:
            return built, None
        key = (id(probe), kernel.spec.id)
        if key not in self._outputs:
            self._outputs[key] = output_problem(module, built, probe, self.ctx, portable=kernel.spec.portable)
        problem = self._outputs[key]
        if problem is not None:
            self.faults.output_wrong(kernel, where(name, module), problem)
            return None, f"output check failed: {problem}"
        return built, None


def _mismatch(actual: Any, expected: Any, what: str) -> str | None:
    """How ``actual`` differs from ``expected`` in structure, shape, dtype or device, or None."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{what} is {type(actual).__name__}, where the module's own forward returns a tensor"
        for aspect, a, e in (("shape", tuple(actual.shape), tuple(expected.shape)),
                           ("dtype", actual.dtype, expected.dtype), ("device", actual.device, expected.device)):
            if a != e:
                return f"{what} has {aspect} {a}, where the module's own forward gives {e}"
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            size = f" of {len(actual)}" if isinstance(actual, (tuple, list)) else ""
            return (f"{what} is {type(actual).__name__}{size}, where the module's own forward returns "
                    f"{type(expected).__name__} of {len(expected)}")
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            problem = _mismatch(a, e, f"{what} {index}")
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
