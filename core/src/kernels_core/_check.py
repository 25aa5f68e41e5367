"""Conformance checks: every kernel of the installed plugins against the eager modules it replaces.

A layer kind declares conformance cases (:class:`ConformanceCase`): small real modules of the kind, one per
variant or more. For each kernel, each case's module is built on a device of the kernel's backend in each dtype
the kernel declares; the kind's matcher must accept it in the case's variant (as kernelize would), and the kernel,
applied through the kind's adapter by the same forward objects kernelize binds, must reproduce the module's own
forward: the outputs, and where the kernel declares ``Supports.BACKWARD`` the gradients of the inputs and of every
parameter, within :func:`kernels_core.testing.tolerance` of the dtype times the case's factor. A kernel declaring
``Supports.TORCH_COMPILE`` is run again under ``torch.compile(fullgraph=True)``.

Example:
    >>> from kernels_core._check import check
    >>> from kernels_core.testing import fresh_plugin_manager
    >>> report = check(["portable"], kernels=["any.silu_gated_mlp.recompute"], compile=False,
    ...                plugin_manager=fresh_plugin_manager())
    >>> sorted({(r.device, r.dtype, str(r.status)) for r in report.results})
    [('cpu', 'bfloat16', 'pass'), ('cpu', 'float16', 'pass'), ('cpu', 'float32', 'pass')]
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from ._errors import CheckError
from ._hints import did_you_mean
from ._plugins._diagnostics import runnable_here
from ._plugins._manager import KernelsPluginManager
from ._plugins._manager import get_plugin_manager
from ._plugins._records import KernelProblem
from ._plugins._records import PluginInfo
from ._plugins._records import PluginStatus
from ._plugins._records import ProvidedKernel
from ._plugins._records import ProvidedKind
from ._tolerance import kernel_tolerance
from ._tolerance import rms_tolerance
from ._types import BackendInfo
from ._types import ConformanceCase
from ._types import StatusEnum
from ._types import Supports


__all__ = [
    "DEFAULT_COMPILE_BACKEND",
    "CheckReport",
    "CheckResult",
    "CheckStatus",
    "check",
    "tolerance",
]

# Traces forward and backward through Dynamo and AOTAutograd as inductor would (graph breaks and untraceable
# autograd code fail), without generating code: seconds per case on a CPU. ``inductor`` checks the generated code.
DEFAULT_COMPILE_BACKEND = "aot_eager"
_DTYPE_ORDER = ("float32", "bfloat16", "float16", "float64")
_IMPLS = "kernels_core._check_impls"
_COUNTER = itertools.count()
def tolerance(dtype: Any) -> float:
    """The relative error bound of a kernel against the eager module in ``dtype`` (a ``torch.dtype``): the
    ``kernel`` column of :data:`kernels_core.plugin.TOLERANCES`, which says why each bound is what it is.

    Example:
        >>> import torch
        >>> tolerance(torch.bfloat16) > tolerance(torch.float16) > tolerance(torch.float32)
        True
    """
    return kernel_tolerance(dtype)


class CheckStatus(StatusEnum):
    """The outcome of one row of a check; a string too, so it compares, prints and encodes as its value.

    Example:
        >>> CheckStatus.PASS == "pass", f"{CheckStatus.SKIPPED}"
        (True, 'skipped')
    """

    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


PASS, FAIL, SKIPPED = CheckStatus.PASS, CheckStatus.FAIL, CheckStatus.SKIPPED


@dataclass(frozen=True)
class CheckResult:
    """One kernel on one case, device and dtype: ``pass``, ``fail`` (with the error and bound) or ``skipped``."""

    kernel: str
    plugin: str
    kind: str
    status: CheckStatus
    device: str | None = None
    dtype: str | None = None
    case: str | None = None
    error: float | None = None
    bound: float | None = None
    reason: str | None = None
    traceback: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def result_text(self) -> str:
        if self.status == PASS:
            return "pass" if self.error is None else f"pass (max err {self.error:.1e})"
        if self.status == FAIL:
            text = "FAIL"
            if self.error is not None and self.bound is not None:
                text += f" max err {self.error:.2e} (bound {self.bound:.1e})"
            return f"{text}: {self.reason}" if self.reason else text
        return f"skipped: {self.reason}"


@dataclass(frozen=True)
class CheckReport:
    """Every result of one check, printable as a table and as JSON."""

    results: tuple[CheckResult, ...]
    compile_backend: str | None = DEFAULT_COMPILE_BACKEND

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.failed)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        counts = {status: sum(r.status == status for r in self.results) for status in (PASS, FAIL, SKIPPED)}
        kernels = len({r.kernel for r in self.results if r.kernel != "-"})
        return (f"{kernels} kernel(s) checked: {counts[PASS]} passed, {counts[FAIL]} failed, "
                f"{counts[SKIPPED]} skipped")

    def table(self) -> str:
        from ._report import format_table

        rows = [(r.kernel, r.plugin, r.device or "-", r.dtype or "-", r.case or "-", r.result_text())
                for r in self.results]
        return format_table(("kernel", "plugin", "device", "dtype", "case", "result"), rows)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(), "compile_backend": self.compile_backend,
                "results": [asdict(r) for r in self.results]}


def _unknown(kind: str, names: Iterable[str], known: Iterable[str]) -> None:
    known = sorted(known)
    missing = [name for name in names if name not in known]
    if not missing:
        return
    hints = []
    for name in missing:
        hints.append(f"{name!r}{did_you_mean(name, known)}")
    raise CheckError(f"unknown {kind} {', '.join(hints)}; installed {kind}s: {', '.join(known) or 'none'}")


def check(
    plugins: Sequence[str] = (),
    *,
    kernels: Sequence[str] = (),
    plugin_manager: KernelsPluginManager | None = None,
    compile: bool = True,
    compile_backend: str = DEFAULT_COMPILE_BACKEND,
) -> CheckReport:
    """Check the kernels of ``plugins`` (all installed plugins when empty), or only ``kernels`` (ids).

    A plugin that failed to load is a failure; a blocked one is skipped. Raises :class:`CheckError` for a
    plugin or kernel name that is not installed, naming the closest one.
    """
    pm = plugin_manager or get_plugin_manager()
    infos = {info.name: info for info in pm.plugins}
    _unknown("plugin", plugins, infos)
    selected = set(plugins) or set(infos)
    provided = [p for p in pm.kernels() if p.plugin.name in selected]
    rejected = [(spec, info, reason) for spec, info, reason in pm.rejected_kernels()
                if info.name in selected and (not kernels or spec.id in kernels)]
    _unknown("kernel", kernels, {p.spec.id for p in provided} | {spec.id for spec, _, _ in rejected})
    results: list[CheckResult] = []
    for name in sorted(selected):
        info = infos[name]
        if info.status != PluginStatus.LOADED:
            status = SKIPPED if info.status == PluginStatus.BLOCKED else FAIL
            results.append(CheckResult("-", name, "-", status, reason=f"plugin {info.status}: {info.reason}"))
            continue
        # What kernelize would warn about once and go on without: a mistake all the same.
        results.extend(CheckResult("-", name, "-", FAIL, reason=problem) for problem in pm.plugin_problems(name))
        if plugins and not any(p.plugin.name == name for p in provided) and not any(
                info.name == name for _, info, _ in rejected):
            results.append(CheckResult("-", name, "-", SKIPPED, reason="the plugin declares no kernels"))
    # A declared kernel that kernelize never uses fails, with the verdict `kernels-core kernels` lists.
    results.extend(CheckResult(spec.id, info.name, spec.kind, FAIL, reason=f"{KernelProblem.REJECTED}: {reason}")
                   for spec, info, reason in rejected)
    kinds = pm.layer_kinds()
    backends = pm.backends()
    verdicts = pm.kernel_problems()
    zoo: list[tuple[Any, str, Any]] = []
    zoo_problems: dict[str, str | None] = {}
    for item in provided:
        if kernels and item.spec.id not in kernels:
            continue
        missing = [(status, detail) for status, detail in verdicts.get(item.spec.id, ())
                   if status == KernelProblem.IMPL_MISSING]
        if missing:
            results.extend(CheckResult(item.spec.id, item.plugin.name, item.spec.kind, FAIL,
                                       reason=f"{status}: {detail}") for status, detail in missing)
            continue
        kind = kinds.get(item.spec.kind)
        if kind is not None and item.spec.kind not in zoo_problems:
            zoo_problems[item.spec.kind] = _zoo_problem(kind, zoo)
        if kind is not None and zoo_problems[item.spec.kind]:
            results.append(CheckResult(item.spec.id, item.plugin.name, item.spec.kind, FAIL, case="model zoo",
                                       reason=zoo_problems[item.spec.kind]))
        results.extend(_check_kernel(item, kind, backends, compile_backend=compile_backend if compile else None))
    return CheckReport(tuple(results), compile_backend if compile else None)


def _zoo_modules(zoo: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    """``(module, qualified name, root)``, one per module class of a tiny model of every family the core is tested
    on (:data:`kernels_core.testing.FAMILIES`): what kernelize shows every matcher, built once per check."""
    if zoo:
        return zoo
    import torch

    from ._kinds._conformance import FAMILIES
    from ._kinds._conformance import tiny_causal_lm

    seen: set[type] = set()
    with torch.random.fork_rng(devices=[]):
        for family in FAMILIES:
            model = tiny_causal_lm(family)
            for name, module in model.named_modules():
                if type(module) not in seen:
                    seen.add(type(module))
                    zoo.append((module, name, model))
    return zoo


def _zoo_problem(kind: ProvidedKind, zoo: list[tuple[Any, str, Any]]) -> str | None:
    """Why the kind's matcher fails on the module classes of real models (it raises on some), or None.

    A conformance case shows a matcher its own target alone; kernelize shows it every module of the model, and a
    matcher that raises there leaves those modules alone with a warning each run.
    """
    from ._kinds._context import MatchContext
    from ._refs import load_ref

    try:
        matcher = load_ref(kind.kind.matcher)
    except Exception:  # noqa: BLE001 - reported by each case's row
        return None
    raised: dict[str, str] = {}
    contexts: dict[int, Any] = {}
    for module, name, root in _zoo_modules(zoo):
        ctx = contexts.setdefault(id(root), MatchContext(root))
        try:
            matcher(module, name, ctx)
        except Exception as exc:  # noqa: BLE001 - the finding
            raised.setdefault(type(module).__name__, _message(exc))
    if not raised:
        return None
    classes = sorted(raised)
    shown = ", ".join(classes[:6]) + (f" and {len(classes) - 6} more" if len(classes) > 6 else "")
    return (f"the kind's matcher {kind.kind.matcher} (plugin {kind.plugin.name!r}) raised on {len(classes)} module "
            f"class(es) of real models ({shown}), e.g. {raised[classes[0]]}; kernelize leaves those modules alone "
            "and warns. A matcher returns None for a module it does not handle: check the module's type or "
            "attributes before reading them")


def _cases(kind: ProvidedKind) -> tuple[tuple[ConformanceCase, ...] | None, str | None]:
    """(the kind's cases or None when it declares none, why they could not be loaded)."""
    from ._refs import load_ref

    if kind.kind.conformance is None:
        if kind.plugin.name == "builtin":
            from ._kinds._conformance import CORE_CASES

            return CORE_CASES.get(kind.kind.name), None
        return None, None
    try:
        cases = tuple(load_ref(kind.kind.conformance)())
    except Exception as exc:  # noqa: BLE001 - the kind's plugin is at fault; every other kernel is still checked
        return None, f"the kind's conformance cases {kind.kind.conformance} failed: {type(exc).__name__}: {exc}"
    bad = [c for c in cases if not isinstance(c, ConformanceCase)]
    if bad:
        return None, f"{kind.kind.conformance} returned {type(bad[0]).__name__}, expected ConformanceCase"
    return cases, None


def _check_kernel(item: ProvidedKernel, kind: ProvidedKind | None, backends: list[tuple[BackendInfo, Any]], *,
                  compile_backend: str | None) -> list[CheckResult]:
    from ._refs import load_ref

    spec = item.spec
    base = {"kernel": spec.id, "plugin": item.plugin.name, "kind": spec.kind}
    if kind is None:
        return [CheckResult(**base, status=FAIL, reason=f"layer kind {spec.kind!r} is not declared")]
    cases, problem = _cases(kind)
    if problem:
        return [CheckResult(**base, status=FAIL, reason=problem)]
    if not cases:
        return [CheckResult(**base, status=SKIPPED, reason="kind declares no conformance test")]
    device, _info, why = runnable_here(spec, backends)
    if device is None:
        return [CheckResult(**base, status=SKIPPED, reason=why)]
    problem = _device_problem(device)
    if problem:
        return [CheckResult(**base, device=device, status=SKIPPED, reason=problem)]
    try:
        impl = load_ref(spec.impl)
    except Exception as exc:  # noqa: BLE001 - reported, the other kernels are still checked
        return [CheckResult(**base, device=device, status=FAIL,
                            reason=f"impl {spec.impl} failed to import: {type(exc).__name__}: {exc}")]
    if not callable(impl):
        return [CheckResult(**base, device=device, status=FAIL, reason=f"impl {spec.impl} is not callable")]
    results = [CheckResult(**base, device=device, case=f"variant {variant}", status=SKIPPED,
                           reason="the kind has no conformance case for this variant")
               for variant in spec.variants if not any(c.variant == variant for c in cases)]
    applicable = [c for c in cases if c.variant in spec.variants]
    dtypes = sorted(spec.dtypes, key=_DTYPE_ORDER.index)
    for dtype in dtypes:
        for case in applicable:
            results.append(_run(case, kind, spec, impl, device, dtype, base, compile_backend=None))
    if compile_backend is not None and Supports.TORCH_COMPILE in spec.supports:
        # One dtype suffices: tracing does not depend on it, and each compile costs seconds.
        for case in applicable:
            results.append(_run(case, kind, spec, impl, device, dtypes[0], base, compile_backend=compile_backend))
    return results


def _device_problem(device: str) -> str | None:
    """Why torch cannot hold a tensor on ``device`` in this process (a runtime missing or emulated), or None."""
    import torch

    try:
        torch.empty(1, device=device)
    except Exception as exc:  # noqa: BLE001 - any failure means nothing can run there
        return f"torch cannot place tensors on {device} here: {_message(exc)}"
    return None


def _register(fn: Callable[..., Any]) -> str:
    """A fresh ``module:attr`` reference to ``fn``: kernelize's forward objects take kernels by reference."""
    module = sys.modules.get(_IMPLS)
    if module is None:
        module = sys.modules[_IMPLS] = types.ModuleType(_IMPLS)
    name = f"k{next(_COUNTER)}"
    setattr(module, name, fn)
    return f"{_IMPLS}:{name}"


def _unregister(ref: str) -> None:
    module = sys.modules.get(_IMPLS)
    if module is not None:
        module.__dict__.pop(ref.partition(":")[2], None)


def _kernel_forward(target: Any, kind: ProvidedKind, spec: Any, ref: str, match: Any) -> Callable[..., Any]:
    """The forward kernelize would bind to ``target`` for this kernel (the module itself is left unchanged), built
    now as kernelize builds it: a build at the first call would be a graph break under torch.compile."""
    from ._forward import ForwardPlan
    from ._forward import KernelForward
    from ._forward import PlannedKernel
    from ._forward import ReroutedForward

    # The kernel's impl counted (``ref``), and no plugin named in an exception's note: the check reports it itself.
    kernel = ProvidedKernel(replace(spec, impl=ref), PluginInfo(name="", module=""))
    plan = ForwardPlan("", target, (PlannedKernel(kernel, kind, match, {}),))
    return ReroutedForward(plan) if kind.kind.target == "global" else KernelForward(plan)


def _traceback(exc: BaseException | None) -> str | None:
    """The formatted traceback of a plugin's exception (``check --json``, ``check --traceback``), or None."""
    if exc is None:
        return None
    import traceback

    return "".join(traceback.format_exception(exc))


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def _compiled_failure(exc: BaseException, eager: Callable[[], Any]) -> str:
    """Why the compiled run failed, as the kernel's own exception where there is one.

    Dynamo reports an exception raised in traced code as its own (``Unsupported: Observed exception``), the
    kernel's exception at most a few causes down, as a ``torch._dynamo`` stand-in: the same inputs are run
    eagerly to get the exception itself. A kernel that runs eagerly failed only under torch.compile.
    """
    try:
        eager()
    except Exception as eager_exc:  # noqa: BLE001 - the kernel's own exception
        return f"the kernel raised {_message(eager_exc)} (eagerly too; under torch.compile: {_message(exc)})"
    cause: BaseException | None = exc
    while cause is not None and type(cause).__module__.startswith("torch._dynamo"):
        cause = cause.__cause__ or cause.__context__
    own = f" ({_message(cause)})" if cause is not None and cause is not exc else ""
    return f"the kernel raised under torch.compile: {_message(exc)}{own}"


def _compare(pairs: list[tuple[str, Any, Any]], bound: float, rms_bound: float
             ) -> tuple[float, str, str | None]:
    """(largest relative error, where, a problem or None) over (what, actual, expected) pairs: a structural problem,
    or a root-mean-square relative error above ``rms_bound`` (the largest error may still be within ``bound``)."""
    worst, where = 0.0, ""
    for what, actual, expected in pairs:
        if expected is None:
            continue
        if actual is None:
            return float("inf"), what, f"{what}: the kernel gives no gradient"
        if actual.shape != expected.shape:
            return float("inf"), what, f"{what}: shape {tuple(actual.shape)}, the module gives {tuple(expected.shape)}"
        if actual.dtype != expected.dtype:
            return float("inf"), what, f"{what}: dtype {actual.dtype}, the module gives {expected.dtype}"
        a, e = actual.detach().double(), expected.detach().double()
        if not bool(a.isfinite().all()) and bool(e.isfinite().all()):
            return float("inf"), what, f"{what}: non-finite values where the module has none"
        if not e.numel():
            continue
        err = float((a - e).abs().max() / e.abs().max().clamp_min(1e-12))
        if err > worst or not where:
            worst, where = err, what
        rms = float((a - e).norm() / e.norm().clamp_min(1e-12))
        if err <= bound and rms > rms_bound:
            return err, what, (f"{what}: root-mean-square relative error {rms:.2e} (bound {rms_bound:.1e}): more than "
                               "rounding, which spreads over the elements")
    return worst, where, None


# Rows real models feed a kernel that random inputs of magnitude ~1 never do: all zeros (padding, a fresh
# embedding), tiny values (where an epsilon decides the result) and large ones (residual streams reach hundreds).
EDGE_ROW_SCALES = (0.0, 1e-3, 64.0)


def _with_edge_rows(value: Any) -> Any:
    """``value`` with its first rows (last dimension) scaled by :data:`EDGE_ROW_SCALES`, when it is a floating-point
    tensor of at least two dimensions with more rows than that; anything else unchanged."""
    import torch

    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2):
        return value
    rows = value.detach().clone().reshape(-1, value.shape[-1])
    if rows.shape[0] <= len(EDGE_ROW_SCALES):
        return value
    for index, scale in enumerate(EDGE_ROW_SCALES):
        rows[index] *= scale
    return rows.reshape(value.shape)


def _run(case: ConformanceCase, kind: ProvidedKind, spec: Any, impl: Callable[..., Any], device_str: str,
         dtype_name: str, base: dict[str, str], *, compile_backend: str | None) -> CheckResult:
    import torch

    label = f"{case.variant}: {case.name}" + (f" [compiled, {compile_backend}]" if compile_backend else "")
    dtype = getattr(torch, dtype_name)
    bound = case.factor * tolerance(dtype)

    def result(status: CheckStatus, reason: str | None = None, error: float | None = None,
               exc: BaseException | None = None) -> CheckResult:
        return CheckResult(**base, device=device_str, dtype=dtype_name, case=label, status=status, reason=reason,
                           error=error, bound=bound if error is not None else None, traceback=_traceback(exc))

    training = Supports.BACKWARD in spec.supports
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        prepared = _prepare(case, kind, torch.device(device_str), dtype, training, result)
        if isinstance(prepared, CheckResult):
            return prepared
        target, verdict, run, leaves = prepared
        try:
            expected, expected_grads = run(target)
        except Exception as exc:  # noqa: BLE001 - the reference cannot run here (a dtype the device lacks)
            return result(SKIPPED, f"the module's own forward fails in {dtype_name} on {device_str}: {_message(exc)}")
        ran = _run_kernel(target, kind, spec, impl, verdict, run, compile_backend, result)
        if isinstance(ran, CheckResult):
            return ran
        actual, actual_grads = ran
    pairs = [(f"output {i}", a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=False))]
    if len(actual) != len(expected):
        return result(FAIL, f"{len(actual)} outputs, the module gives {len(expected)}")
    pairs += [(what, a, e) for (what, _), a, e in zip(leaves, actual_grads, expected_grads, strict=True)]
    error, where, problem = _compare(pairs, bound, case.factor * rms_tolerance(dtype))
    if problem:
        return result(FAIL, problem, error if error != float("inf") else None)
    if error > bound:
        return result(FAIL, f"worst: {where}", error)
    return result(PASS, error=error)


def _prepare(case: ConformanceCase, kind: ProvidedKind, device: Any, dtype: Any, training: bool,
             result: Callable[..., CheckResult]) -> CheckResult | tuple[Any, Any, Callable[..., Any], list[Any]]:
    """The case's module, built on ``device`` in ``dtype`` and accepted by the kind's matcher in the case's variant,
    its verdict, a function running a forward (and, ``training``, a backward) on the case's inputs, and the tensors
    whose gradients it returns; or why the row fails or is skipped."""
    import torch

    from ._kinds._context import MatchContext
    from ._refs import load_ref
    from ._types import Match

    try:
        root, target_name = case.build(device, dtype)
        target = root.get_submodule(target_name)
    except Exception as exc:  # noqa: BLE001 - e.g. a dtype the device cannot hold
        return result(SKIPPED, f"the case's module cannot be built here: {_message(exc)}")
    root.train(training)
    try:
        verdict = load_ref(kind.kind.matcher)(target, target_name, MatchContext(root))
    except Exception as exc:  # noqa: BLE001 - the kind's plugin is at fault; the other rows still run
        return result(FAIL, f"the kind's matcher {kind.kind.matcher} (plugin {kind.plugin.name!r}) raised "
                            f"{_message(exc)}", exc=exc)
    if not isinstance(verdict, Match):
        why = getattr(verdict, "reason", "it returned no match")
        return result(FAIL, f"the kind's matcher does not accept the case's module: {why}")
    if verdict.variant != case.variant:
        return result(FAIL, f"the kind's matcher reports variant {verdict.variant!r}, the case {case.variant!r}")
    try:
        args, kwargs = case.inputs(target, torch.Generator().manual_seed(1))
    except Exception as exc:  # noqa: BLE001
        return result(FAIL, f"the case's inputs raised {_message(exc)}", exc=exc)
    if case.edge_rows:
        args = tuple(_with_edge_rows(value) for value in args)
    leaves: list[tuple[str, Any]] = []
    if training:
        for index, value in enumerate(args):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                leaves.append((f"grad of input {index}", value.requires_grad_()))
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                leaves.append((f"grad of {key}", value.requires_grad_()))
        leaves += [(f"grad of {name}", p) for name, p in target.named_parameters() if p.requires_grad]
    grad_mode = torch.enable_grad if training else torch.no_grad

    def run(fn: Callable[..., Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        with grad_mode():
            outputs = tuple(case.outputs(fn(*args, **kwargs)))
            if not training:
                return outputs, ()
            upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(o) for o in outputs]
            grads = torch.autograd.grad(outputs, [leaf for _, leaf in leaves], upstream, allow_unused=True)
        return outputs, tuple(grads)

    return target, verdict, run, leaves


def _run_kernel(target: Any, kind: ProvidedKind, spec: Any, impl: Callable[..., Any], verdict: Any,
                run: Callable[..., Any], compile_backend: str | None, result: Callable[..., CheckResult]
                ) -> CheckResult | tuple[Any, Any]:
    """``run`` through the forward kernelize would bind to ``target`` (compiled with ``compile_backend``, if any): the
    outputs and gradients; or why the row fails, or is skipped where the adapter never called the kernel."""
    import torch

    calls = [0]

    # The impl's own attributes stay visible, as they are to an adapter in kernelize.
    @functools.wraps(impl)
    def counted(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return impl(*a, **k)

    ref = _register(counted)
    try:
        try:
            forward = _kernel_forward(target, kind, spec, ref, verdict)
        except Exception as exc:  # noqa: BLE001 - the kind's plugin is at fault; the other rows still run
            return result(FAIL, f"the kind's adapter {kind.kind.adapter} (plugin {kind.plugin.name!r}) raised "
                                f"{_message(exc)}", exc=exc)
        fn: Callable[..., Any] = forward
        if compile_backend is not None:
            torch._dynamo.reset()
            fn = torch.compile(lambda *a, **k: forward(*a, **k), fullgraph=True, backend=compile_backend)
        try:
            outputs = run(fn)
        except Exception as exc:  # noqa: BLE001 - the kernel's failure is the result
            if compile_backend is None:
                return result(FAIL, f"the kernel raised {_message(exc)}", exc=exc)
            return result(FAIL, _compiled_failure(exc, lambda: run(forward)), exc=exc)
    finally:
        _unregister(ref)
        if compile_backend is not None:
            torch._dynamo.reset()
    if not calls[0]:
        return result(SKIPPED, "the kind's adapter did not call the kernel on this case")
    return outputs
