"""The per-instance forwards kernelize binds, and the record that lets unkernelize undo them exactly.

Both forwards are small picklable objects holding *references* (``module:attr`` strings) rather than functions,
so ``copy.deepcopy``, ``torch.save``/``torch.load`` and pickling keep a kernelized model kernelized; the callable
they dispatch to is rebuilt lazily after a copy or a load. An exception raised through one keeps its type and gains
a note naming the kernel, its plugin, the module and the configuration line that turns the kernel off.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import ClassVar

from ._types import Match


__all__ = [
    "MISSING",
    "BindingRecord",
    "GlobalOverride",
    "KernelForward",
    "ReroutedForward",
    "decorator_chain_problem",
    "load_ref",
    "locate_problem",
    "ref_problem",
    "rewrap",
]

logger = logging.getLogger(__name__)


class _Missing:
    """Marks an instance attribute that did not exist before binding (restored by deleting it)."""

    _instance: ClassVar[_Missing | None] = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass
class BindingRecord:
    """Stored in a bound module's ``__dict__``: the instance attributes kernelize replaced, and by what.

    ``previous`` holds what each attribute was before binding, ``bound`` what kernelize set it to: an attribute
    that no longer holds its ``bound`` value was replaced by other code since (a wrapper), which restoring
    ``previous`` would silently drop.
    """

    MISSING: ClassVar[_Missing] = MISSING
    previous: dict[str, object] = field(default_factory=dict)
    kernels: tuple[tuple[str, str], ...] = ()
    bound: dict[str, object] = field(default_factory=dict)


# Process-wide caches of objects that never change once made: imported callables, and the synthetic modules whose
# globals rerouted forwards run with (one per distinct set of overrides, shared so that torch.compile sees one
# globals dict per class forward). Synthetic module names come from a counter and are registered under a lock:
# two threads building at once must never give two namespaces one name in ``sys.modules``.
_REF_CACHE: dict[str, object] = {}
_REROUTED_NAMESPACES: dict[tuple[object, ...], dict[str, Any]] = {}
_REROUTED_LOCK = threading.Lock()
_SYNTHETIC_NUMBERS = itertools.count()


def load_ref(ref: str) -> Any:
    """Import ``package.module:attr.path`` and return the attribute (cached)."""
    if ref not in _REF_CACHE:
        module_name, _, attr_path = ref.partition(":")
        obj: object = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
        _REF_CACHE[ref] = obj
    return _REF_CACHE[ref]


def ref_problem(ref: str) -> str | None:
    """Why ``ref`` cannot be loaded (imported, resolved, callable), or None; importing it if needed.

    Example:
        >>> ref_problem("json:dumps") is None
        True
        >>> ref_problem("json:no_such_function")
        "cannot be loaded: AttributeError: module 'json' has no attribute 'no_such_function'"
    """
    try:
        obj = load_ref(ref)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"cannot be loaded: {type(exc).__name__}: {exc}"
    return None if callable(obj) else f"is not callable ({type(obj).__name__})"


def _find_spec(name: str, path: Any) -> Any:
    # The import system's finders, asked without executing anything (editable installs use meta-path finders).
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, path)
        except Exception:  # noqa: BLE001 - a finder that cannot answer is no evidence either way
            continue
        if spec is not None:
            return spec
    return None


def locate_problem(ref: str) -> str | None:
    """Why the module of ``ref`` cannot be found, importing nothing that is not imported yet; None if found.

    Only an attribute of an already imported module is checked; otherwise finding the file is enough.

    Example:
        >>> locate_problem("json:dumps") is None
        True
        >>> locate_problem("no_such_package_xyz.ops:f")
        "module 'no_such_package_xyz' not found"
    """
    module_name, _, attr_path = ref.partition(":")
    parts = module_name.split(".")
    path = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        module = sys.modules.get(name)
        if module is not None:
            path = getattr(module, "__path__", None)
        else:
            spec = _find_spec(name, path)
            if spec is None:
                return f"module {name!r} not found"
            path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return f"module {'.'.join(parts[: i + 2])!r} not found ({name!r} is not a package)"
    module = sys.modules.get(module_name)
    if module is not None:
        obj: object = module
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                return f"module {module_name!r} has no attribute {attr_path!r}"
            obj = getattr(obj, part)
    return None


_NOTE_PREFIX = "kernels-core: "


def _add_note(exc: BaseException, note: str) -> None:
    """Add ``note`` to an exception raised through a kernelized forward, once (the innermost forward's)."""
    if any(str(n).startswith(_NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
        return
    if hasattr(exc, "add_note"):
        exc.add_note(_NOTE_PREFIX + note)
    else:  # pragma: no cover - Python 3.10 has no exception notes
        logger.error("%s%s", _NOTE_PREFIX, note)


def _disable_hint(kernel_ids: tuple[str, ...]) -> str:
    ids = ", ".join(f'"{k}"' for k in kernel_ids)
    return (f"to run without it, set kernels.disable = [{ids}] in kernels.toml (or in kernelize's config "
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


def _build_once(forward: _LazyForward) -> Callable[..., Any]:
    if forward._fn is None:
        forward._fn = forward._build()
    return forward._fn


def _built(forward: _LazyForward) -> Callable[..., Any]:
    """The forward's callable, built now if a copy or a load left it unbuilt.

    Under ``torch.compile`` the build runs outside the graph (one break, at the first compiled call after a copy):
    Dynamo cannot trace imports and function construction.
    """
    import torch

    if torch.compiler.is_compiling():
        return torch.compiler.disable(_build_once)(forward)
    return _build_once(forward)


class _LazyForward:
    """Shared behaviour: lazy build, pickling without the built callable, the original signature."""

    module: Any
    _fn: Callable[..., Any] | None
    # Where the forward is bound, for error notes; class defaults keep forwards pickled without them loadable.
    module_name: str = ""

    def _build(self) -> Callable[..., Any]:
        raise NotImplementedError

    def _callable(self) -> Callable[..., Any]:
        return self._fn if self._fn is not None else _built(self)

    def _failure_note(self) -> str:
        raise NotImplementedError

    def _where(self) -> str:
        name = f"{self.module_name!r} " if self.module_name else ""
        return f"module {name}({type(self.module).__qualname__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Once per kernelized module per step: one frame less than going through _callable(); the try costs
        # nothing unless something raises.
        fn = self._fn
        try:
            return (fn if fn is not None else _built(self))(*args, **kwargs)
        except Exception as exc:
            _add_note(exc, self._failure_note())
            raise

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def __signature__(self) -> inspect.Signature:
        # transformers (Trainer column pruning, generate) inspects model.forward's parameters.
        return inspect.signature(type(self.module).forward.__get__(self.module, type(self.module)))


class KernelForward(_LazyForward):
    """A module's forward replaced by a kernel through its layer kind's adapter.

    Example:
        ``module.forward(x)`` calls ``adapter(module, match, impl, options)(x)``, the adapter being built once.
    """

    # Class defaults: forwards pickled before these attributes existed still load and still annotate errors.
    plugin: str = ""
    origin: str = ""

    def __init__(
        self,
        module: Any,
        *,
        kernel_id: str,
        kind: str,
        impl: str,
        adapter: str,
        match: Match,
        options: dict[str, object],
        plugin: str = "",
        origin: str = "",
        module_name: str = "",
    ) -> None:
        self.module = module
        self.kernel_id = kernel_id
        self.kind = kind
        self.impl = impl
        self.adapter = adapter
        self.match = match
        self.options = dict(options)
        self.plugin = plugin
        self.origin = origin
        self.module_name = module_name
        self._fn = None

    def _build(self) -> Callable[..., Any]:
        return load_ref(self.adapter)(self.module, self.match, load_ref(self.impl), self.options)

    def _failure_note(self) -> str:
        plugin = f" of plugin {self.plugin!r} ({self.origin})" if self.plugin else ""
        return (f"raised in kernel {self.kernel_id!r}{plugin}, bound to {self._where()} as its {self.kind} "
                f"forward (impl {self.impl}); {_disable_hint((self.kernel_id,))}")

    def __repr__(self) -> str:
        return f"<kernels_core forward {self.kernel_id} of {type(self.module).__name__}>"


@dataclass(frozen=True)
class GlobalOverride:
    """One global function of a module's forward rerouted to a kernel (for ``target="global"`` kinds)."""

    kernel_id: str
    kind: str
    global_name: str
    impl: str
    adapter: str
    match: Match
    options: dict[str, object] = field(default_factory=dict)
    plugin: str = ""
    origin: str = ""


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

    _scoped: tuple[Any, ...] = ()
    _variants: dict[tuple[object, ...], Callable[..., Any]] | None = None

    def __init__(self, module: Any, *, overrides: tuple[GlobalOverride, ...], module_name: str = "") -> None:
        self.module = module
        self.overrides = tuple(overrides)
        self.module_name = module_name
        self._fn = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            fn = self._callable()  # builds self._scoped and self._variants too
            if self._scoped and self._variants is not None:
                # A list comprehension, not a generator expression: Dynamo traces those on every supported torch.
                fn = self._variants[tuple([scoped.call_fact(args, kwargs) for scoped in self._scoped])]
            return fn(*args, **kwargs)
        except Exception as exc:
            _add_note(exc, self._failure_note())
            raise

    def _failure_note(self) -> str:
        # The class forward runs here too: the exception may come from the model's own code or from a kernel.
        kernels = ", ".join(
            f"{o.kernel_id!r} for {o.global_name}" + (f" (plugin {o.plugin!r}, {o.origin})" if o.plugin else "")
            for o in self.overrides)
        return (f"raised in the forward of {self._where()}, which runs with kernels {kernels} in place of the "
                f"global functions it calls; {_disable_hint(self.kernel_ids)}")

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_scoped": (), "_variants": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Rebuilt at once rather than at the first call: the first call may be traced by torch.compile, and Dynamo
        # cannot trace the build (fullgraph would fail on a copy). The build reads only the module's class, which
        # a copy or a load has already fixed, never its half-restored state.
        try:
            self._fn = self._build()
        except Exception:  # noqa: BLE001 - e.g. a kernel package missing where the model is loaded; the first
            self._fn = None  # call rebuilds and raises there, naming what failed

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
            return {o.global_name: load_ref(o.adapter)(self.module, o.match, load_ref(o.impl), o.options)
                    for o in self.overrides}

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
        self._scoped, self._variants = scoped, variants
        return next(iter(variants.values()))

    def __repr__(self) -> str:
        return f"<kernels_core rerouted forward {', '.join(self.kernel_ids)} of {type(self.module).__name__}>"


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
