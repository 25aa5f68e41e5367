"""The forward objects kernelize binds, each made whole from what planning decided for one module
(:class:`ForwardPlan`, :func:`forward_for`): a module's forward replaced by a kernel, or its class forward re-created
with some global functions pointing at kernels; and the instance attributes that bind each (:func:`bindings`: the
module's forward, or where the kernel's plugin puts it).

Both hold *references* (``module:attr`` strings) to a kernel's code rather than functions and build the callable
they dispatch to from them, once. A copy or a load leaves it unbuilt: ``copy.deepcopy`` keeps the references, while
a pickle saves only kernel ids, which a load looks up among the installed plugins (:mod:`kernels_core.persisted`).
An exception raised through one keeps its type and gains a note naming the kernel, its plugin, the module and the
configuration line that turns the kernel off; raised by the model's own code instead, it names the kernels bound
inside the module, nearest the failing code first.

Every call first checks that the kernels still serve the module as it is now: its parameters' dtype against the
dtypes the kernels declare, and their device type against the one kernelize bound them for. A model converted or
moved after kernelize (``model.double()``, ``.half()``, ``.cpu()``) runs the module's own forward where a kernel
does not serve it, warns once per kernel and cause, and :func:`kernels_core.get_report` says so; so does a loaded
model whose kernels are not installed, or cannot be built, where it was loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import sys
import threading
import types
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from ._binding import MISSING  # noqa: F401 - kernels-core 0.1.0 defined it here, and its pickles name it so
from ._binding import BindingRecord  # noqa: F401 - the same
from ._binding import record_of
from ._errors import KernelizeError
from ._plugins._fallbacks import warn_fallback
from ._plugins._records import PluginInfo
from ._plugins._records import ProvidedKernel
from ._plugins._records import ProvidedKind
from ._refs import load_ref
from ._types import Binding
from ._types import Match
from .persisted import Persisted


__all__ = [
    "Declared",
    "ForwardPlan",
    "GlobalOverride",
    "KernelForward",
    "PlannedKernel",
    "ReroutedForward",
    "bindings",
    "decorator_chain_problem",
    "forward_for",
    "rewrap",
    "takes_base",
    "tensors_in",
]

logger = logging.getLogger("kernels_core")  # the package's one logger


# A process-wide cache of objects that never change once made: the synthetic modules whose globals rerouted forwards
# run with (one per distinct set of overrides, shared so that torch.compile sees one globals dict per class forward).
# Synthetic module names come from a counter and are registered under a lock: two threads building at once must
# never give two namespaces one name in ``sys.modules``.
_REROUTED_NAMESPACES: dict[tuple[object, ...], dict[str, Any]] = {}
_REROUTED_LOCK = threading.Lock()
_SYNTHETIC_NUMBERS = itertools.count()


_NOTE_PREFIX = "kernels-core: "
# How a note begins when the exception came from code no kernel replaced: each enclosing kernelized forward, which
# sees more of the kernels that ran before, replaces it with its own.
_OUTSIDE = "raised outside any kernel"


# The attribute an adapter's callable may carry: a function returning why the kernel does not run on the model as
# it is now (the adapter then calls the module's own forward), or None.
RUNTIME_PROBLEM_ATTR = "kernels_core_runtime_problem"

def _add_note(exc: BaseException, forward: _LazyForward) -> None:
    """Note, on an exception raised through ``forward``, which kernels are involved and how to run without them.

    The innermost kernelized forward's note stays when it names the kernel that raised; one saying the exception
    came from outside any kernel is replaced by each enclosing forward's, which lists more of the kernels bound
    inside the model (one that ran earlier may have returned a wrong shape, dtype or value).
    """
    import torch

    if torch.compiler.is_compiling():
        # Dynamo cannot trace this bookkeeping (it reports "Unsupported hasattr call" instead of the exception);
        # left alone, it reports the kernel's own exception, and an eager rerun of the frame gets the note.
        return
    notes = getattr(exc, "__notes__", None)
    index = next((i for i, n in enumerate(notes or ()) if str(n).startswith(_NOTE_PREFIX)), None)
    if index is not None and not str(notes[index]).startswith(_NOTE_PREFIX + _OUTSIDE):
        return
    try:
        note = _NOTE_PREFIX + forward._failure_note(exc)
    except Exception:  # noqa: BLE001 - the note must never replace the exception it explains
        logger.debug("kernels-core could not describe an exception raised through %r", forward, exc_info=True)
        return
    if index is not None:
        notes[index] = note
    elif hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10 has no exception notes
        logger.error("%s", note)


def _frames(exc: BaseException) -> list[types.FrameType]:
    """The frames an exception passed through below the one handling it now, outermost first."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[1:]


def _codes(*callables: Any) -> set[types.CodeType]:
    """The code objects of these callables' own bodies (through partials and decorators, whose wrapper code is often
    shared by unrelated functions) or, for a callable object, of its class's ``__call__``."""
    codes: set[types.CodeType] = set()
    for obj in callables:
        while isinstance(obj, functools.partial):
            obj = obj.func
        fn = inspect.unwrap(getattr(obj, "__func__", obj))
        code = getattr(fn, "__code__", None)
        if code is None and callable(obj) and not isinstance(obj, type):
            code = getattr(type(obj).__call__, "__code__", None)
        if isinstance(code, types.CodeType):
            codes.add(code)
    return codes


def _loaded(ref: str) -> Any:
    """``load_ref(ref)``, or None where it cannot load (a note never fails for that)."""
    try:
        return load_ref(ref)
    except Exception:  # noqa: BLE001
        return None


def _ran(frames: list[types.FrameType], codes: set[types.CodeType]) -> bool:
    return any(frame.f_code in codes for frame in frames)


def _qualified(prefix: str, name: str) -> str:
    return ".".join(part for part in (prefix, name) if part)


def _module_path(forward: _LazyForward, frames: list[types.FrameType]) -> list[tuple[str, Any]]:
    """(qualified name, module) of the forward's module and of its sub-modules whose code the exception passed
    through, outermost first: the last is the module whose code raised."""
    names = {id(m): (n, m) for n, m in forward.module.named_modules()}
    path: list[tuple[str, Any]] = []
    for frame in frames:
        found = names.get(id(frame.f_locals.get("self")))
        if found is not None and (not path or path[-1][1] is not found[1]):
            path.append((_qualified(forward.module_name, found[0]), found[1]))
    return path


@functools.cache
def _method_signature(forward: Callable[..., Any]) -> inspect.Signature:
    """The signature of a module class's ``forward`` (``self`` first, as a method's function has it)."""
    return inspect.signature(forward)


def forward_object(value: object) -> _LazyForward | None:
    """The kernels-core forward in a bound attribute: the forward itself, or its :attr:`_LazyForward.bound_forward`
    method; None for anything else (a plugin's own binding)."""
    if isinstance(value, types.MethodType):
        value = value.__self__
    return value if isinstance(value, _LazyForward) else None


def forwards_in(record: BindingRecord | None) -> list[_LazyForward]:
    """The kernels-core forwards among what a binding record says kernelize bound (none for a plugin's own)."""
    return [f for f in map(forward_object, record.bound.values()) if f is not None] if record is not None else []


def _forward_of_module(module: Any) -> _LazyForward:
    """The kernels-core forward kernelize bound to ``module``, for a call whose ``self`` is the module."""
    found = forwards_in(record_of(module))
    if len(found) != 1:
        raise KernelizeError(f"a kernels-core forward was called on {type(module).__qualname__}, which holds "
                             f"{len(found)} kernels-core forwards; kernelize the model again")
    return found[0]


def _kernels_of(value: object) -> list[tuple[str, str]]:
    """(kernel id, what to say about it) of each kernel a bound forward runs."""
    value = forward_object(value)
    if isinstance(value, KernelForward):
        return [(value.kernel_id, f" (plugin {value.plugin!r})" if value.plugin else "")]
    if isinstance(value, ReroutedForward):
        return [(o.kernel_id, f" for {o.global_name}" + (f" (plugin {o.plugin!r})" if o.plugin else ""))
                for o in value.overrides]
    return []


def _bound_kernels(module: Any) -> list[tuple[str, str]]:
    """(kernel id, what to say about it) of each kernel kernelize bound to this one module."""
    record = record_of(module)
    if record is None:
        return []
    found = [kernel for value in record.bound.values() for kernel in _kernels_of(value)]
    known = {kernel_id for kernel_id, _ in found}
    # A plugin's own binding holds other objects: the record still names its kernels.
    found.extend((kernel_id, "") for _kind, kernel_id in record.kernels if kernel_id not in known)
    return found


def _outside_note(forward: _LazyForward, path: list[tuple[str, Any]]) -> str:
    """The note for an exception that no kernel of ``forward`` raised: the kernels bound inside its module, those
    nearest the code that raised first (the likeliest to have handed it something wrong)."""
    failing, failing_module = path[-1] if path else (forward.module_name, forward.module)
    failing_parts = failing.split(".") if failing else []
    ranked: list[tuple[int, int, str, str, str]] = []
    for order, (name, module) in enumerate(forward.module.named_modules()):
        qualified = _qualified(forward.module_name, name)
        parts = qualified.split(".") if qualified else []
        shared = 0
        while shared < min(len(parts), len(failing_parts)) and parts[shared] == failing_parts[shared]:
            shared += 1
        # The forward's own kernels, even where it is not bound through kernelize (a copy, a test).
        kernels = _kernels_of(forward) if module is forward.module else _bound_kernels(module)
        ranked.extend((-shared, order, kernel_id, qualified, about) for kernel_id, about in kernels)
    ranked.sort()
    first: dict[str, tuple[str, str]] = {}
    count: dict[str, int] = {}
    for _shared, _order, kernel_id, qualified, about in ranked:
        first.setdefault(kernel_id, (qualified, about))
        count[kernel_id] = count.get(kernel_id, 0) + 1
    listed = "; ".join(
        f"{kernel_id!r}{about} on {qualified or '(model)'!r}"
        + (f" and {count[kernel_id] - 1} other module(s)" if count[kernel_id] > 1 else "")
        for kernel_id, (qualified, about) in first.items())
    return (f"{_OUTSIDE}, in the code of module {failing or '(model)'!r} ({type(failing_module).__qualname__}), "
            f"inside {forward._where()}. A kernel that ran before it may have returned a wrong shape, dtype or "
            f"value; the kernels bound there, nearest first: {listed}; {_disable_hint(tuple(first))}")


def _disable_hint(kernel_ids: tuple[str, ...]) -> str:
    ids = ", ".join(f'"{k}"' for k in kernel_ids)
    which = "it" if len(kernel_ids) == 1 else "them"
    return (f"to run without {which}, set kernels.disable = [{ids}] in kernels.toml (or in kernelize's config "
            "argument), or call kernels_core.unkernelize(model)")


def _inner_cell(wrapper: Any) -> int | None:
    """Index of the closure cell through which a decorator's wrapper calls the function it wraps, or None."""
    inner = getattr(wrapper, "__wrapped__", None)
    cells = [i for i, cell in enumerate(getattr(wrapper, "__closure__", None) or ()) if cell.cell_contents is inner]
    return cells[0] if len(cells) == 1 else None


def decorator_chain_problem(forward: Any) -> str | None:
    """Why the decorators around a class forward cannot be re-created around a rerouted copy, or None if they can.

    A ``functools.wraps`` decorator (transformers' ``capture_outputs``, ``merge_with_config_defaults``, ...) calls
    the function it wraps through one closure cell; re-creating the wrapper with that cell pointing at the
    rerouted copy keeps everything the decorator does. Wrappers that hold it some other way are left alone.

    Example:
        >>> import functools
        >>> def deco(fn):
        ...     @functools.wraps(fn)
        ...     def wrapper(*args, **kwargs):
        ...         return fn(*args, **kwargs)
        ...     return wrapper
        >>> decorator_chain_problem(deco(lambda self: self)) is None
        True
    """
    fn = forward
    while hasattr(fn, "__wrapped__"):
        if not isinstance(fn, types.FunctionType) or _inner_cell(fn) is None:
            what = getattr(fn, "__qualname__", type(fn).__name__)
            return (f"the class forward is wrapped by {what!r}, which does not hold the function it wraps in one "
                    "closure cell, so it cannot be re-created around a rerouted copy")
        fn = fn.__wrapped__
    return None if isinstance(fn, types.FunctionType) else "the class forward is not a plain Python function"


def rewrap(wrapper: Any, innermost: types.FunctionType) -> types.FunctionType:
    """``wrapper`` (a decorator chain) re-created around ``innermost`` instead of the function it wrapped.

    Example:
        >>> import functools
        >>> def deco(fn):
        ...     @functools.wraps(fn)
        ...     def wrapper(*args, **kwargs):
        ...         return fn(*args, **kwargs) + 1
        ...     return wrapper
        >>> rewrap(deco(lambda x: x), lambda x: 10 * x)(2)
        21
    """
    if not hasattr(wrapper, "__wrapped__"):
        return innermost
    inner = rewrap(wrapper.__wrapped__, innermost)
    index = _inner_cell(wrapper)
    if index is None:
        raise TypeError(decorator_chain_problem(wrapper))
    closure = list(wrapper.__closure__)
    closure[index] = types.CellType(inner)
    rebuilt = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__,
                                 tuple(closure))
    rebuilt.__kwdefaults__ = wrapper.__kwdefaults__
    rebuilt.__dict__.update(wrapper.__dict__)
    rebuilt.__wrapped__ = inner
    rebuilt.__qualname__ = wrapper.__qualname__
    rebuilt.__doc__ = wrapper.__doc__
    return rebuilt


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def tensors_in(value: object) -> list[Any]:
    """The tensors in a forward's output: a tensor, or one inside tuples, lists and dicts (``ModelOutput``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def _build_once(forward: _LazyForward) -> Callable[..., Any] | None:
    if forward._fn is None and forward._unresolved is None:
        try:
            forward._fn = forward._build()
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be built where a copy runs falls back
            ids = ", ".join(d.kernel_id for d in forward.declared)
            forward._unresolved = f"{ids} cannot be built here: {type(exc).__name__}: {exc}"
            forward._derive()
    return forward._fn


def _built(forward: _LazyForward) -> Callable[..., Any] | None:
    """The forward's callable, built now if a copy or a load left it unbuilt; None if it cannot be built here.

    Under ``torch.compile`` the build runs outside the graph (one break, at the first compiled call after a copy):
    Dynamo cannot trace imports and function construction.
    """
    import torch

    if torch.compiler.is_compiling():
        return torch.compiler.disable(_build_once)(forward)
    return _build_once(forward)


def _installed(kernel_id: str, kind: str) -> tuple[str, str] | str:
    """(impl, adapter) of kernel ``kernel_id`` of layer kind ``kind`` among the plugins installed in this process,
    or why it is not there: how a loaded forward finds its kernels (see :mod:`kernels_core.persisted`)."""
    from ._plugins._manager import get_plugin_manager

    pm = get_plugin_manager()
    spec = next((p.spec for p in pm.kernels() if p.spec.id == kernel_id), None)
    if spec is None:
        return f"{kernel_id} is not installed where the model was loaded (no installed plugin declares it)"
    if spec.kind != kind:
        return f"{kernel_id} is a kernel of layer kind {spec.kind!r} where the model was loaded, not of {kind!r}"
    layer = pm.layer_kinds().get(kind)
    if layer is None:
        return f"layer kind {kind!r} of {kernel_id} is not installed where the model was loaded"
    return spec.impl, layer.kind.adapter


@dataclass(frozen=True)
class Declared(Persisted):
    """What one bound kernel serves, which every call of its forward checks against the module's parameters.

    ``device_type`` is the device type the parameters had when kernelize bound the kernel (``"cuda"``), or None
    where any device serves (a portable kernel, or kernelize was told the device the model will run on).
    ``preferred``: configuration asked for this kernel, so a call it cannot serve raises instead of falling back.
    """

    kernel_id: str
    plugin: str
    origin: str
    dtypes: tuple[str, ...]
    backend: str
    device_type: str | None = None
    preferred: bool = False


@dataclass(frozen=True)
class PlannedKernel:
    """One kernel planned for a module: the kernel and its layer kind as installed, the matcher's verdict, the
    kind's options, and whether configuration prefers the kernel (``preferred``)."""

    kernel: ProvidedKernel
    kind: ProvidedKind
    match: Match
    options: Mapping[str, object]
    preferred: bool = False

    def declared(self, device_type: str | None) -> Declared:
        """What this kernel serves, for a forward whose parameters are on ``device_type`` now (None: any device)."""
        spec, plugin = self.kernel.spec, self.kernel.plugin
        return Declared(kernel_id=spec.id, plugin=plugin.name, origin=plugin.origin, dtypes=spec.dtypes,
                        backend=spec.backend, device_type=None if spec.portable else device_type,
                        preferred=self.preferred)

    def describe(self) -> str:
        """The kernel and its kind, with the plugins, adapter and impl: for an error that involves both."""
        spec, plugin, kind = self.kernel.spec, self.kernel.plugin, self.kind
        return (f"kernel {spec.id!r} of plugin {plugin.name!r} (distribution {plugin.distribution or 'unknown'}), "
                f"kind {kind.kind.name!r} (adapter {kind.kind.adapter} of plugin {kind.plugin.name!r}, impl "
                f"{spec.impl})")


@dataclass(frozen=True)
class ForwardPlan:
    """What planning decided for one module, complete: its kernels (one of a ``target="forward"`` kind, or those
    of ``target="global"`` kinds its class forward is re-created with), the guards its forward needs (``guards``:
    what each kernel serves; ``probe``: the module and name of the parameter each call checks, or None), and, for a
    forward kernel, the callable its kind's adapter built while planning (``built``; None: the forward builds it).
    """

    name: str
    module: Any
    kernels: tuple[PlannedKernel, ...]
    guards: tuple[Declared, ...] = ()
    probe: tuple[Any, str] | None = None
    built: Callable[..., Any] | None = None

    @property
    def target(self) -> str:
        return self.kernels[0].kind.kind.target

    @property
    def bound(self) -> tuple[tuple[str, str], ...]:
        """The (kind, kernel id) pairs the module's binding record names."""
        return tuple((p.kind.kind.name, p.kernel.spec.id) for p in self.kernels)


def forward_for(plan: ForwardPlan) -> KernelForward | ReroutedForward:
    """The finished forward of a planned module; one that cannot be built raises :class:`KernelizeError` naming every
    kernel involved."""
    try:
        return KernelForward(plan) if plan.target == "forward" else ReroutedForward(plan)
    except Exception as exc:
        kernels = "; ".join(p.describe() for p in plan.kernels)
        ids = ", ".join(f'"{p.kernel.spec.id}"' for p in plan.kernels)
        raise KernelizeError(
            f"binding to module {plan.name or '(model)'!r} ({type(plan.module).__qualname__}) failed while building "
            f"its forward: {kernels}: {type(exc).__name__}: {exc}. The model is unchanged; to kernelize without it, "
            f"set kernels.disable = [{ids}]") from exc


def bindings(plans: Iterable[ForwardPlan], bind_hook_of: Callable[[str], Callable[..., object] | None]
             ) -> Iterator[tuple[Any, dict[str, object], tuple[tuple[str, str], ...]]]:
    """Each planned module's finished forward, and the attributes that bind it, made one at a time (a binding
    transaction reads them after undoing every earlier binding, :func:`kernels_core._binding.rebind`): by default the
    module's forward, or what the kernel's plugin decides (its ``kernels_core_bind_kernel``, from ``bind_hook_of``:
    a :class:`~kernels_core.Binding` that changes no parameter, buffer or sub-module; None keeps the default)."""
    import torch

    for plan in plans:
        forward = forward_for(plan).bound_forward
        (planned, *_others) = plan.kernels
        spec, plugin = planned.kernel.spec, planned.kernel.plugin
        hook = bind_hook_of(plugin.name) if plan.target == "forward" else None
        try:
            binding = None if hook is None else hook(module=plan.module, match=planned.match, kernel=spec,
                                                     forward=forward)
        except Exception as exc:
            raise KernelizeError(f"plugin {plugin.name!r} ({plugin.origin}) failed to bind kernel {spec.id} to "
                                 f"{plan.name}: {type(exc).__name__}: {exc}") from exc
        if binding is not None and not isinstance(binding, Binding):
            raise KernelizeError(f"plugin {plugin.name!r} returned {type(binding).__name__} from kernels_core_bind_"
                                 f"kernel for {spec.id} on {plan.name}; expected kernels_core.Binding or None")
        attributes = {"forward": forward} if binding is None else dict(binding.attributes)
        for attr, value in attributes.items():
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                raise KernelizeError(f"plugin {plugin.name!r} tried to bind a module/tensor to {plan.name}.{attr}; "
                                     "bindings must not change parameters, buffers or sub-modules")
        yield plan.module, attributes, plan.bound


def _fallback_message(forward: _LazyForward, declared: Declared, cause: str) -> str:
    plugin = f" of plugin {declared.plugin!r} ({declared.origin})" if declared.plugin else ""
    return (f"kernel {declared.kernel_id!r}{plugin} does not run on {forward._where()} (nor on other modules like "
            f"it): {cause}, so the module's own forward runs instead; kernels_core.get_report(model) lists every "
            "such module. kernels_core.kernelize(model) again chooses the kernels that serve the model as it is now")


class _LazyForward(Persisted):
    """Shared behaviour: lazy build, saving kernel ids rather than code references, the original signature, and the
    per-call check that the module's parameters are still in a dtype and on a device type the kernels serve.

    Saved: the module, the kernels by id with what they declare, and the parameter each call reads (its module's
    parameter dict, read afresh because accelerate's offloading and FSDP put new parameter objects there, and its
    name). Rebuilt after a load: code references, the callable, why the kernels cannot run here (``_unresolved``),
    the torch dtypes every kernel declares and the ``Tensor.is_<device type>`` flag that must hold (or None).
    """

    # 0.1.0 saved _scoped and _variants too (a rerouted forward's call-fact variants, now in its callable).
    _transient = frozenset({"impl", "adapter", "_fn", "_globals", "_unresolved", "_dtypes", "_device_flag",
                            "_preferred", "_scoped", "_variants", "_checked", "_unchecked", "_wrong_dtype",
                            "_bound"})
    module: Any
    module_name: str
    declared: tuple[Declared, ...]
    _probe_params: dict[str, Any] | None
    _probe_name: str
    _fn: Callable[..., Any] | None
    _unresolved: str | None

    def _start(self, plan: ForwardPlan) -> None:
        """Everything a call needs, from the plan: what each call checks (see the module docstring; without a probe
        parameter, nothing), and the callable, built by the kind's adapter while planning or else now."""
        self.module, self.module_name, self.declared = plan.module, plan.name, plan.guards
        probe = plan.probe
        self._probe_params, self._probe_name = (probe[0]._parameters, probe[1]) if probe is not None else (None, "")
        # kernelize checked the kernels' outputs, dtype included, against the module's own forward on parameters
        # of the dtype they have now; any other declared dtype is checked at its first call.
        now = getattr(self._probe_params.get(self._probe_name), "dtype", None) if probe is not None else None
        self._output_dtypes_checked({now} if now is not None else set(), {})
        self._fn, self._unresolved = None, None
        self._derive()
        # Built now, not at the first call: a failure belongs to kernelize, and a first call may be traced by
        # torch.compile, which cannot trace the build.
        self._fn = plan.built if plan.built is not None else self._build()

    def _output_dtypes_checked(self, checked: set[Any], wrong: dict[Any, str]) -> None:
        """Which parameter dtypes the kernels' output dtypes are known right for (``checked``), and where they are
        known wrong, why (``wrong``): see ``_first_call_in``."""
        self._checked, self._wrong_dtype = checked, wrong

    def _derive(self) -> None:
        """What each call checks, from ``declared`` and the probe parameter: when made, after a copy or a load."""
        import torch

        declared = self.declared
        # Kernels that cannot run here serve no dtype: every call runs the module's own forward.
        common = set.intersection(*(set(d.dtypes) for d in declared)) if declared and not self._unresolved else set()
        # The parameter's dtype now first: the membership test usually ends at the first, identical, item.
        now = getattr((self._probe_params or {}).get(self._probe_name), "dtype", None)
        if "_checked" not in self.__dict__:  # a copy or a load: each dtype's first call checks the output
            self._output_dtypes_checked(set(), {})
        served = {getattr(torch, dtype) for dtype in common} - self._wrong_dtype.keys()
        # Only dtypes whose output was checked take the fast path; the others are checked once, off it.
        self._dtypes = tuple(sorted(served & self._checked, key=lambda d: d != now))
        self._unchecked = frozenset(served - self._checked)
        device_type = next((d.device_type for d in declared if d.device_type is not None), None)
        flag = f"is_{device_type}"
        # A device type without a cheap ``is_`` flag (an out-of-tree backend) is not checked per call.
        self._device_flag = flag if device_type is not None and hasattr(torch.Tensor, flag) else None
        self._preferred = any(d.preferred for d in declared)

    def runtime_problems(self) -> list[tuple[Declared, str]]:
        """Each kernel of this forward that does not serve the module's parameters as they are now, with why.

        The same check every call makes, spelled out; empty when every kernel runs (or nothing is checked).
        """
        if self._unresolved:
            return [(declared, self._unresolved) for declared in self.declared]
        # An adapter whose forward routes some calls to the module's own forward for a reason of the model's state
        # (the fused loss under ZeRO-3 with a LoRA head) says why through this attribute of its callable.
        check = getattr(self._fn, RUNTIME_PROBLEM_ATTR, None)
        routed = check() if check is not None else None
        if routed:
            return [(declared, routed) for declared in self.declared]
        params = self._probe_params
        probe = params.get(self._probe_name) if params is not None else None
        if probe is None:
            return []
        dtype = str(probe.dtype).removeprefix("torch.")
        device_type = probe.device.type
        problems = []
        wrong = self._wrong_dtype.get(probe.dtype)
        for declared in self.declared:
            if dtype not in declared.dtypes:
                problems.append((declared, f"the module's parameters are {dtype} now, and {declared.kernel_id} "
                                           f"declares {', '.join(declared.dtypes)}"))
            elif wrong is not None:
                problems.append((declared, wrong))
            elif (self._device_flag is not None and declared.device_type is not None
                  and device_type != declared.device_type):
                problems.append((declared, f"the module's parameters are on {device_type} now, and "
                                           f"{declared.kernel_id} (backend {declared.backend}) was bound for "
                                           f"{declared.device_type} tensors"))
        return problems

    def _fall_back(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the module's own forward, warning once per kernel and cause (or raise for a preferred kernel)."""
        import torch

        if not torch.compiler.is_compiling():
            self._note_fallback()
        elif self._preferred:
            # Raising leaves the graph anyway; the message cannot be built inside it.
            torch.compiler.disable(self._note_fallback)()
        # Warnings cannot be issued from a traced graph: under torch.compile the report alone says so.
        module = self.module
        return type(module).forward(module, *args, **kwargs)

    def _note_fallback(self) -> None:
        problems = self.runtime_problems()
        for declared, cause in problems:
            if declared.preferred:
                raise KernelizeError(
                    f"kernel {declared.kernel_id!r}, preferred by configuration, cannot run on {self._where()}: "
                    f"{cause}. Kernelize the model again as it is now (the preference then raises there, or picks "
                    "what serves it), or call kernels_core.unkernelize(model)")
        for declared, cause in problems:
            warn_fallback(PluginInfo(name=declared.plugin, module=""), declared.kernel_id, cause,
                          _fallback_message(self, declared, cause))

    def _first_call_in(self, dtype: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first call since the parameters became ``dtype``, a declared dtype kernelize did not bind for (the
        model was converted after kernelize): the kernels run, and their output must have the dtypes the module's
        own forward gives, or the next layer fails on it ("expected m1 and m2 to have the same dtype"). Where it
        has not, the module's own forward runs from now on for this dtype, with a warning, as for an undeclared
        dtype.

        Floating-point outputs in the parameters' dtype are taken as right without running anything else; only
        where one differs (a kernel returning float32, or a float32 loss, which the module's own forward returns
        too) does the module's own forward run once on the same arguments to compare. Its result is the call's
        result where the kernel's is wrong, so the kernel's value is never used.
        """
        fn = self._fn if self._fn is not None else _built(self)
        if fn is None:
            return self._fall_back(args, kwargs)
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            _add_note(exc, self)
            raise
        found = [t.dtype for t in tensors_in(out) if t.is_floating_point()]
        wrong = None
        if any(d != dtype for d in found):
            module = self.module
            own = type(module).forward(module, *args, **kwargs)
            expected = [t.dtype for t in tensors_in(own) if t.is_floating_point()]
            if found != expected:
                name = str(dtype).removeprefix("torch.")
                returns = ", ".join(dict.fromkeys(str(d).removeprefix("torch.") for d in found))
                gives = ", ".join(dict.fromkeys(str(d).removeprefix("torch.") for d in expected))
                wrong = (f"the module's parameters are {name} now, a dtype kernelize did not bind for, and the kernel "
                         f"returns {returns} where the module's own forward gives {gives}")
                out = own
        if wrong is None:
            self._checked = self._checked | {dtype}
        else:
            self._wrong_dtype = {**self._wrong_dtype, dtype: wrong}
        self._derive()
        if wrong is not None:
            self._note_fallback()
        return out

    def _build(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _find_kernels(self) -> None:
        """After a load: each kernel's code references, found by id among the installed plugins, or why not."""
        raise NotImplementedError

    def _failure_note(self, exc: BaseException) -> str:
        raise NotImplementedError

    def _where(self) -> str:
        name = f"{self.module_name!r} " if self.module_name else ""
        return f"module {name}({type(self.module).__qualname__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Once per kernelized module per step: the try costs nothing unless something raises. The check is a dict
        # lookup and two attribute reads (under torch.compile, guards on the parameter rather than graph code);
        # for a rerouted forward, one kernel that does not serve the parameters runs the class forward without any.
        if not isinstance(self, _LazyForward):
            # Code wrapping a module's forward may bind the function of the method kernelize put there to the
            # module itself, taking it for the module's own method (accelerate's mixed precision does).
            self = _forward_of_module(self)
        params = self._probe_params
        if params is not None:
            probe = params.get(self._probe_name)
            if probe is not None and (probe.dtype not in self._dtypes or (
                    self._device_flag is not None and not getattr(probe, self._device_flag))):
                if probe.dtype not in self._unchecked or (
                        self._device_flag is not None and not getattr(probe, self._device_flag)):
                    return self._fall_back(args, kwargs)
                # A traced call cannot run the one-time comparison (nor keep its result): it runs the kernels
                # unchecked, and an eager call checks them.
                if not _compiling():
                    return self._first_call_in(probe.dtype, args, kwargs)
        fn = self._fn
        if fn is None:
            fn = _built(self)
            if fn is None:
                return self._fall_back(args, kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            _add_note(exc, self)
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A load: the kernels are found by id among the installed plugins. 0.1.0 pickles, which named these classes
        # directly and saved code references and derived values as well, load the same way.
        self.__dict__.update(module_name="", declared=(), _probe_params=None, _probe_name="")
        self.__dict__.update({key: value for key, value in state.items() if key not in self._transient})
        self._fn, self._unresolved = None, None
        self._find_kernels()
        self._ready()

    def __deepcopy__(self, memo: dict[int, Any]) -> _LazyForward:
        # A copy in this process keeps the kernels this forward found, through whichever plugin manager kernelize
        # used; only a load looks them up again.
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__reduce__()[2], memo))
        # A kernel forward's code references come along here; a rerouted forward's overrides copy as themselves.
        clone.__dict__.update({key: getattr(self, key) for key in ("impl", "adapter") if key in self.__dict__})
        clone._fn, clone._unresolved = None, self._unresolved
        # The same kernels on the same parameters: what their outputs were checked for still holds.
        clone._output_dtypes_checked(set(self._checked), dict(self._wrong_dtype))
        clone._ready()
        return clone

    def _ready(self) -> None:
        """After a copy or a load: what each call checks, and (rerouted forwards) the callable."""
        self._derive()
        self._sign_bound()

    @property
    def __signature__(self) -> inspect.Signature:
        # transformers (Trainer column pruning, generate) inspects model.forward's parameters.
        return inspect.signature(type(self.module).forward.__get__(self.module, type(self.module)))

    @property
    def bound_forward(self) -> types.MethodType:
        """This forward as the method kernelize puts in its module's forward slot.

        A method whose function has the code of ``__call__``: torch.compile guards a module's replaced forward by
        that code when it is a method, and by the object's identity otherwise, so with a callable object in the
        slot each decoder layer compiled on its own (FSDP2 recipes) traced again until Dynamo's recompile limit
        left the rest uncompiled. Each forward's function is its own, carrying the module's signature. A method
        pickles as ``getattr(forward, "bound_forward")``; a load may ask for it before the forward's fields are
        back (the module and its forward refer to each other), so the signature is filled in when they are.
        """
        bound = self.__dict__.get("_bound")
        if bound is None:
            call = _LazyForward.__call__
            function = types.FunctionType(call.__code__, call.__globals__, "bound_forward")
            function.__qualname__ = f"{type(self).__qualname__}.bound_forward"
            bound = self.__dict__["_bound"] = types.MethodType(function, self)
            self._sign_bound()
        return bound

    def _sign_bound(self) -> None:
        bound, module = self.__dict__.get("_bound"), self.__dict__.get("module")
        if bound is not None and module is not None and "__signature__" not in bound.__func__.__dict__:
            bound.__func__.__signature__ = _method_signature(type(module).forward)


class KernelForward(_LazyForward):
    """A module's forward replaced by a kernel through its layer kind's adapter.

    ``module.forward(x)`` calls ``adapter(module, match, impl, options)(x)``, the adapter being built once.
    """

    def __init__(self, plan: ForwardPlan) -> None:
        (planned,) = plan.kernels
        spec, plugin, kind = planned.kernel.spec, planned.kernel.plugin, planned.kind.kind
        self.kernel_id, self.kind, self.impl, self.adapter = spec.id, kind.name, spec.impl, kind.adapter
        self.match, self.options = planned.match, dict(planned.options)
        self.plugin, self.origin = plugin.name, plugin.origin
        self._start(plan)

    def _build(self) -> Callable[..., Any]:
        return load_ref(self.adapter)(self.module, self.match, load_ref(self.impl), self.options)

    def _find_kernels(self) -> None:
        found = _installed(self.kernel_id, self.kind)
        self.impl, self.adapter = ("", "") if isinstance(found, str) else found
        self._unresolved = found if isinstance(found, str) else None

    def _failure_note(self, exc: BaseException) -> str:
        frames = _frames(exc)
        path = _module_path(self, frames)
        codes = _codes(_loaded(self.impl))
        # Not raised inside the kernel itself but in the adapter's code around it or in a sub-module it calls (a
        # fused decoder layer adding what its MLP returned): a kernel that ran before may be at fault. An impl
        # without Python code (a compiled op) is taken to have raised unless a sub-module did.
        if not (_ran(frames, codes) or (not codes and all(module is self.module for _, module in path))):
            return _outside_note(self, path)
        plugin = f" of plugin {self.plugin!r} ({self.origin})" if self.plugin else ""
        return (f"raised in kernel {self.kernel_id!r}{plugin}, bound to {self._where()} as its {self.kind} "
                f"forward (impl {self.impl}); {_disable_hint((self.kernel_id,))}")

    def __repr__(self) -> str:
        return f"<kernels_core forward {self.kernel_id} of {type(self.module).__name__}>"


@dataclass(frozen=True)
class GlobalOverride(Persisted):
    """One global function of a module's forward rerouted to a kernel (for ``target="global"`` kinds).

    ``impl`` and ``adapter`` are not saved: a load finds them again by kernel id (empty where it cannot).
    """

    _transient = frozenset({"impl", "adapter"})
    kernel_id: str
    kind: str
    global_name: str
    match: Match
    options: dict[str, object] = field(default_factory=dict)
    plugin: str = ""
    origin: str = ""
    impl: str = ""
    adapter: str = ""

    @classmethod
    def of(cls, planned: PlannedKernel) -> GlobalOverride:
        spec, plugin, kind = planned.kernel.spec, planned.kernel.plugin, planned.kind.kind
        return cls(kernel_id=spec.id, kind=kind.name, global_name=str(planned.match.params["global_name"]),
                   match=planned.match, options=dict(planned.options), plugin=plugin.name, origin=plugin.origin,
                   impl=spec.impl, adapter=kind.adapter)

    def __deepcopy__(self, memo: dict[int, Any]) -> GlobalOverride:
        return self  # immutable, and a copy keeps the code references a load would look up again


class ReroutedForward(_LazyForward):
    """The module's class forward, re-created with some of its global names pointing at kernels.

    Only this instance sees the kernels: the modeling module's globals and every other instance are untouched.

    A replacement that needs a fact about the call that only the caller's arguments show (the causal mask: whether
    the model derives its position ids itself) declares ``call_facts`` (the values the fact can take),
    ``call_fact(args, kwargs)`` and ``for_call(fact)`` (itself with the fact fixed). The forward is then built
    once per combination of facts, and each call runs the one its arguments select: the fact travels with the
    call, never through state another thread's call could change, and a trace sees a plain choice of function
    made from which arguments are None.
    """

    def __init__(self, plan: ForwardPlan) -> None:
        self.overrides = tuple(GlobalOverride.of(planned) for planned in plan.kernels)
        self._start(plan)

    def _failure_note(self, exc: BaseException) -> str:
        # The class forward runs here too: the exception may come from a kernel or from the model's own code.
        frames = _frames(exc)
        namespace = self.__dict__.get("_globals", {})
        raised = [o for o in self.overrides
                  if _ran(frames, _codes(_loaded(o.impl), namespace.get(o.global_name)))]
        if not raised:
            return _outside_note(self, _module_path(self, frames))
        kernels = ", ".join(
            f"{o.kernel_id!r} for {o.global_name}" + (f" (plugin {o.plugin!r}, {o.origin})" if o.plugin else "")
            for o in raised)
        return (f"raised in kernel {kernels}, called in place of that global function by the forward of "
                f"{self._where()}; {_disable_hint(tuple(o.kernel_id for o in raised))}")

    def _find_kernels(self) -> None:
        found = [_installed(o.kernel_id, o.kind) for o in self.overrides]
        self.overrides = tuple(o if isinstance(f, str) else dataclasses.replace(o, impl=f[0], adapter=f[1])
                               for o, f in zip(self.overrides, found, strict=True))
        # One rerouted forward: where one of its kernels cannot run, the class forward runs without any.
        self._unresolved = "; ".join(dict.fromkeys(f for f in found if isinstance(f, str))) or None

    def _ready(self) -> None:
        # Built at once rather than at the first call: the first call may be traced by torch.compile, and Dynamo
        # cannot trace the build (fullgraph would fail on a copy). The build reads only the module's class, which
        # a copy or a load has already fixed, never its half-restored state.
        super()._ready()
        _build_once(self)

    @property
    def kernel_ids(self) -> tuple[str, ...]:
        return tuple(o.kernel_id for o in self.overrides)

    def _build(self) -> Callable[..., Any]:
        decorated = type(self.module).forward
        base = inspect.unwrap(decorated)
        key = (base.__module__, base.__qualname__, id(base.__code__), tuple(
            (o.global_name, o.impl, o.adapter, repr(sorted(o.match.params.items())), repr(sorted(o.options.items())))
            for o in self.overrides
        ))

        def replacements() -> dict[str, Any]:
            values: dict[str, Any] = {}
            # An adapter that takes ``base`` wraps what another kind put in place of the same global (the packed-
            # rows attention around the sliding-window one), so it is built after it; kernelize binds at most one
            # adapter that does not per global.
            adapters = sorted(((o, load_ref(o.adapter)) for o in self.overrides), key=lambda p: takes_base(p[1]))
            for o, adapter in adapters:
                chained = {"base": values[o.global_name]} if o.global_name in values else {}
                values[o.global_name] = adapter(self.module, o.match, load_ref(o.impl), o.options, **chained)
            return values

        namespace = _shared_namespace(key, base, replacements)
        names = [o.global_name for o in self.overrides if hasattr(namespace[o.global_name], "call_facts")]
        scoped = tuple(namespace[name] for name in names)
        variants: dict[tuple[object, ...], Callable[..., Any]] = {}
        for facts in itertools.product(*(replacement.call_facts for replacement in scoped)):
            fixed = {name: replacement.for_call(fact) for name, replacement, fact in zip(names, scoped, facts,
                                                                                          strict=True)}
            variant = _shared_namespace((*key, facts), base, lambda fixed=fixed: {**namespace, **fixed}) if names \
                else namespace
            rerouted = types.FunctionType(base.__code__, variant, base.__name__, base.__defaults__, base.__closure__)
            rerouted.__kwdefaults__ = base.__kwdefaults__
            rerouted.__qualname__ = base.__qualname__
            rerouted.__doc__ = base.__doc__
            # Decorators (transformers wraps model forwards in capture_outputs and the like) keep running around it.
            variants[facts] = rewrap(decorated, rerouted).__get__(self.module, type(self.module))
        self._globals = namespace
        if not scoped:
            return variants[()]

        def by_call(*args: Any, **kwargs: Any) -> Any:
            # A list comprehension, not a generator expression: Dynamo traces those on every supported torch.
            return variants[tuple([replacement.call_fact(args, kwargs) for replacement in scoped])](*args, **kwargs)

        return by_call

    def __repr__(self) -> str:
        return f"<kernels_core rerouted forward {', '.join(self.kernel_ids)} of {type(self.module).__name__}>"


def takes_base(adapter: Callable[..., Any]) -> bool:
    """Whether a global-target adapter composes with another kind's replacement of the same global (``base=``)."""
    try:
        return "base" in inspect.signature(adapter).parameters
    except (TypeError, ValueError):
        return False


def _shared_namespace(key: tuple[object, ...], base: types.FunctionType,
                      replacements: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The globals a rerouted copy of ``base`` runs with: ``base``'s own, with ``replacements()`` put in.

    torch.compile guards a function's globals through the module named by ``__name__`` in them, so the rerouted
    globals belong to a real (synthetic) module, not to a bare dict copy that claims to be the modeling module.
    Forwards with the same ``key`` share one, so compiled layers share their guards.
    """
    namespace = _REROUTED_NAMESPACES.get(key)
    if namespace is not None:
        return namespace
    values = replacements()  # adapters are plugin code: run outside the lock
    with _REROUTED_LOCK:
        namespace = _REROUTED_NAMESPACES.get(key)
        if namespace is None:
            name = f"kernels_core._rerouted.m{next(_SYNTHETIC_NUMBERS)}"
            synthetic = types.ModuleType(name)
            namespace = synthetic.__dict__
            namespace.update({k: v for k, v in base.__globals__.items()
                              if k not in ("__name__", "__spec__", "__loader__", "__package__")})
            namespace.update(values)
            namespace["__name__"] = name
            sys.modules[name] = synthetic
            _REROUTED_NAMESPACES[key] = namespace
    return namespace
