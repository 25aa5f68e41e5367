"""Plain, frozen values that cross the plugin boundary.

Everything a plugin hands to the core is one of these dataclasses. They import neither torch nor kernel code (a
conformance case holds the functions that build its module), so listing devices and kernels stays cheap; each
validates itself on construction so that a malformed declaration fails inside the plugin that made it, where the
loader can isolate it. :func:`device_name` names a device as reports and listings do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import enum
import functools
import re
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from .persisted import Persisted


__all__ = [
    "StatusEnum",
    "BackendInfo",
    "Binding",
    "CapabilityRange",
    "ConformanceCase",
    "DeviceInfo",
    "KernelSpec",
    "Decline",
    "LayerKind",
    "Match",
    "Mode",
    "Supports",
    "declaration_problem",
    "declaring",
    "device_name",
]

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
ANY_BACKEND = "any"
# Set while the core calls a plugin's declaration hooks: a malformed KernelSpec built there is kept, marked with its
# problem, so that the loader rejects that kernel alone instead of losing every kernel the hook would have returned.
# A context variable, so that a KernelSpec built anywhere else (a test, a notebook) still raises at once.
_DECLARING: contextvars.ContextVar[bool] = contextvars.ContextVar("kernels_core_declaring", default=False)
_PROBLEM_ATTR = "_declaration_problem"


@contextlib.contextmanager
def declaring() -> Iterator[None]:
    """While active, a malformed :class:`KernelSpec` is built and marked (:func:`declaration_problem`), not raised.

    Example:
        >>> with declaring():
        ...     spec = KernelSpec(id="acme.rms_norm.x", kind="rms_norm", variants=("standard",), backend="any",
        ...                       impl="acme.ops:rms_norm", prority=10)
        >>> declaration_problem(spec)
        "kernel 'acme.rms_norm.x': KernelSpec has no field 'prority' (did you mean 'priority'?)"
    """
    token = _DECLARING.set(True)
    try:
        yield
    finally:
        _DECLARING.reset(token)


def declaration_problem(value: object) -> str | None:
    """Why a declaration built under :func:`declaring` is malformed, or None."""
    return getattr(value, "__dict__", {}).get(_PROBLEM_ATTR)


class StatusEnum(str, enum.Enum):
    """A status value that is also its string: it compares with, prints and encodes as its value (``enum.StrEnum``
    before Python 3.11).

    Example:
        >>> class Light(StatusEnum):
        ...     ON = "on"
        >>> Light.ON == "on", f"{Light.ON}"
        (True, 'on')
    """

    def __str__(self) -> str:
        return str(self.value)


class Mode(enum.Flag):
    """How the kernelized model will run.

    ``INFERENCE`` and ``TRAINING`` are mutually exclusive; ``TORCH_COMPILE`` may be added to either.

    Example:
        >>> Mode.TRAINING | Mode.TORCH_COMPILE
        <Mode.TRAINING|TORCH_COMPILE: 6>
    """

    INFERENCE = enum.auto()
    TRAINING = enum.auto()
    TORCH_COMPILE = enum.auto()

    def validate(self) -> Mode:
        """Return ``self`` if it is a usable kernelize mode, else raise ``ValueError``."""
        has_inference = bool(self & Mode.INFERENCE)
        has_training = bool(self & Mode.TRAINING)
        if has_inference and has_training:
            raise ValueError("Mode.INFERENCE and Mode.TRAINING are mutually exclusive; pick one.")
        if not (has_inference or has_training):
            raise ValueError(
                f"mode {self!r} must contain Mode.INFERENCE or Mode.TRAINING "
                "(optionally combined with Mode.TORCH_COMPILE)."
            )
        return self


class Supports(enum.Flag):
    """What a kernel can do beyond a plain eager forward pass.

    A kernel without ``BACKWARD`` is inference-only; one without ``TORCH_COMPILE`` is not chosen when the
    kernelize mode includes ``Mode.TORCH_COMPILE``.
    """

    NONE = 0
    BACKWARD = enum.auto()
    TORCH_COMPILE = enum.auto()


def _check_id(value: str, what: str) -> None:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{what} {value!r} must be a lowercase identifier matching {_ID_RE.pattern}")


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"{what} {value!r} must be a snake_case name matching {_NAME_RE.pattern}")


def _check_backend(value: str, what: str, *, portable: bool = False) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        also = f", or {ANY_BACKEND!r} for portable kernels" if portable else ""
        raise ValueError(f"{what} {value!r} must be a lowercase backend name matching {_NAME_RE.pattern}, such as "
                         f"'cuda', 'rocm', 'npu' or 'cpu'{also} (a name, not a torch device: no index, no upper case)")


def _check_ref(value: str, what: str) -> None:
    if not isinstance(value, str) or not _REF_RE.match(value):
        raise ValueError(f"{what} {value!r} must be a lazy reference of the form 'package.module:attribute'")


@dataclass(frozen=True)
class CapabilityRange:
    """An inclusive range of CUDA-style compute capabilities, ``(major, minor)`` tuples.

    Example:
        >>> CapabilityRange(min=(8, 0)).contains((9, 0))
        True
    """

    min: tuple[int, int] = (0, 0)
    max: tuple[int, int] = (999, 999)

    def __post_init__(self) -> None:
        for bound in (self.min, self.max):
            if not (isinstance(bound, tuple) and len(bound) == 2 and all(isinstance(v, int) for v in bound)):
                raise ValueError(f"capability bound {bound!r} must be a (major, minor) tuple of ints")
        if self.min > self.max:
            raise ValueError(f"capability range is empty: min {self.min} > max {self.max}")

    def contains(self, capability: tuple[int, int]) -> bool:
        return self.min <= capability <= self.max

    def __str__(self) -> str:
        return f"{self.min[0]}.{self.min[1]}-{self.max[0]}.{self.max[1]}"


@dataclass(frozen=True)
class DeviceInfo:
    """One device a backend can drive.

    Args:
        index: the torch device index (``cuda:1`` has index 1).
        name: a human-readable name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        capability: CUDA compute capability as ``(major, minor)``, where the backend has one.
        arch: an architecture string where capability numbers do not apply (``"gfx942"``, ``"Ascend910B2"``).
    """

    index: int
    name: str
    capability: tuple[int, int] | None = None
    arch: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"device index {self.index!r} must be a non-negative int")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("device name must be a non-empty string")
        if self.capability is not None and not (
            isinstance(self.capability, tuple) and len(self.capability) == 2
            and all(isinstance(v, int) for v in self.capability)
        ):
            raise ValueError(f"capability {self.capability!r} must be a (major, minor) tuple of ints or None")


def device_name(device_type: str, index: int) -> str:
    """How a tensor on this device prints its device, the name reports and listings use.

    Example:
        >>> device_name("cpu", 0), device_name("cuda", 1)
        ('cpu', 'cuda:1')
    """
    return device_type if device_type == "cpu" else f"{device_type}:{index}"


@dataclass(frozen=True)
class BackendInfo:
    """What one plugin reports about the hardware it can drive.

    Example:
        >>> BackendInfo(backend="cpu", device_type="cpu", devices=(DeviceInfo(0, "host CPU"),), priority=0).count
        1

    Args:
        backend: the backend name kernels are declared for (``"cuda"``, ``"rocm"``, ``"npu"``, ``"cpu"``...).
        device_type: the torch device type its tensors report (ROCm tensors report ``"cuda"``).
        devices: the devices found; empty when the hardware is absent.
        priority: which backend wins when two claim the same torch device; higher wins.
        runtime: runtime or driver version string, informational.
        reason: why no device was found (runtime missing, import failed...), shown by ``kernels-core devices``
            and in errors for an explicit ``device=`` that cannot be honoured.
    """

    backend: str
    device_type: str
    devices: tuple[DeviceInfo, ...] = ()
    priority: int = 0
    runtime: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        _check_backend(self.backend, "backend")
        if self.backend == ANY_BACKEND:
            raise ValueError(f"backend name {ANY_BACKEND!r} is reserved for portable kernels")
        _check_name(self.device_type, "device_type")
        if not isinstance(self.devices, tuple) or not all(isinstance(d, DeviceInfo) for d in self.devices):
            raise ValueError("devices must be a tuple of DeviceInfo")
        if not isinstance(self.priority, int):
            raise ValueError(f"priority {self.priority!r} must be an int")

    @property
    def count(self) -> int:
        return len(self.devices)

    def device(self, index: int) -> DeviceInfo | None:
        return next((d for d in self.devices if d.index == index), None)


@dataclass(frozen=True)
class LayerKind:
    """A family of layers that share one piece of math, e.g. RMSNorm.

    Example:
        >>> LayerKind(name="rms_norm", description="RMS normalisation", variants=("standard", "offset"),
        ...           matcher="kernels_core._kinds._rms_norm:match", adapter="kernels_core._kinds._rms_norm:adapt")
        ... # doctest: +ELLIPSIS
        LayerKind(name='rms_norm', ...)

    Args:
        name: unique snake_case name used by kernel specs and configuration.
        description: one line for listings.
        variants: the variant names the matcher can report; kernels declare the subset they handle.
        matcher: lazy ``module:attr`` of ``match(module, qualified_name, ctx) -> Match | Decline | None``.
        adapter: lazy ``module:attr`` of ``adapt(module, match, impl, options) -> callable`` building the instance
            forward (or, for ``target="global"``, the replacement global function) from a kernel implementation
            that follows this kind's calling convention. Global-target replacements are shared by layers with
            identical matches, so they must depend on the module's class only, not on the instance.
        hint_names: transformers ``kernel_layer_name`` markers that point at this kind.
        target: ``"forward"`` when the adapter returns the module's new forward; ``"global"`` when it returns a
            replacement for one global function the module's forward calls (``match.params["global_name"]``),
            which the core reroutes for that instance only, composing several such kinds on one module.
        options: the configuration options the adapter reads (``[kinds.<name>] options``), each name mapped to
            its type (``bool``, ``int``, ``float``, ``str``, or a tuple of them); configuration naming any other
            option, or a value of another type, raises. ``{}`` declares that the kind takes no options; ``None``
            (the default) leaves options unchecked.
        conformance: lazy ``module:attr`` of ``cases() -> Iterable[ConformanceCase]``: small modules of this kind
            on which ``kernels-core check`` and :func:`kernels_core.testing.assert_conforms` compare every kernel
            of the kind with the module's own forward. ``None``: kernels of the kind are reported unchecked.
        opt_in: the kind's kernels change the numbers on purpose (FP8 matrix products), so nothing chooses them
            automatically: kernelize visits the kind's modules only where configuration names kernels for it in
            ``[kinds.<name>] prefer``, and uses exactly those (raising where none can serve a module). Unrequested,
            the kind costs nothing and adds no report rows.
    """

    name: str
    description: str
    variants: tuple[str, ...]
    matcher: str
    adapter: str
    hint_names: tuple[str, ...] = ()
    target: str = "forward"
    # Excluded from the hash (a dict is unhashable) so that kinds stay usable as set members and cache keys.
    options: Mapping[str, type | tuple[type, ...]] | None = field(default=None, hash=False)
    conformance: str | None = None
    opt_in: bool = False

    def __post_init__(self) -> None:
        _check_name(self.name, "layer kind name")
        if self.target not in ("forward", "global"):
            raise ValueError(f"layer kind {self.name!r}: target {self.target!r} must be 'forward' or 'global'")
        if self.options is not None:
            if not isinstance(self.options, Mapping):
                raise ValueError(f"layer kind {self.name!r}: options must be a mapping of name to type or None")
            for option, kind in self.options.items():
                _check_name(option, f"layer kind {self.name!r}: option name")
                types = kind if isinstance(kind, tuple) else (kind,)
                if not types or not all(isinstance(t, type) for t in types):
                    raise ValueError(f"layer kind {self.name!r}: option {option!r} must map to a type or a tuple "
                                     f"of types, got {kind!r}")
        if not self.variants or not all(isinstance(v, str) and _NAME_RE.match(v) for v in self.variants):
            raise ValueError(f"layer kind {self.name!r}: variants must be a non-empty tuple of snake_case names")
        _check_ref(self.matcher, f"layer kind {self.name!r} matcher")
        _check_ref(self.adapter, f"layer kind {self.name!r} adapter")
        if self.conformance is not None:
            _check_ref(self.conformance, f"layer kind {self.name!r} conformance")
        if not isinstance(self.opt_in, bool):
            raise ValueError(f"layer kind {self.name!r}: opt_in must be a bool, got {self.opt_in!r}")


@dataclass(frozen=True)
class KernelSpec:
    """A declaration of one kernel: what it implements, where it runs, and how to load it.

    Nothing here imports the kernel; ``impl`` is resolved only when kernelize picks it.

    Example:
        >>> KernelSpec(id="cpu.rms_norm.example", kind="rms_norm", variants=("standard",), backend="cpu",
        ...            impl="my_pkg.kernels:rms_norm", priority=10, supports=Supports.BACKWARD,
        ...            dtypes=("float32",)).id
        'cpu.rms_norm.example'

    Args:
        id: globally unique kernel id, conventionally ``<backend>.<kind>.<name>``.
        kind: the :class:`LayerKind` name it implements.
        variants: variants of the kind it handles (e.g. ``("standard", "offset")`` for RMSNorm).
        backend: the backend it runs on, or ``"any"`` for portable PyTorch kernels.
        impl: lazy ``module:attr`` reference to the implementation, following the kind's calling convention.
        priority: higher is preferred among kernels that qualify for a module.
        supports: backward and torch.compile support.
        dtypes: parameter dtypes it accepts, by torch name without the ``torch.`` prefix.
        capability: compute-capability range, for backends that report one.
        archs: architecture strings it is restricted to (ROCm gfx names, Ascend SoCs); empty means any.
        requires: distributions it needs, as PEP 508 requirement strings (``"liger-kernel>=0.8"``).
        description: one line for listings and reports.
        native_when_compiled: the kernelize modes (each with ``Mode.TORCH_COMPILE``) in which ``impl``, traced by
            torch.compile, runs only plain PyTorch ops, handing Inductor the math to fuse with its neighbours.
            Where such a kernel would be chosen automatically, kernelize leaves the module on its own forward:
            the compiled graph would be the same, and the binding would only add Dynamo guards, checked on every
            call (a third of a CUDA-graphed decoding step on Qwen3-0.6B). A kernel named in ``prefer`` is bound.
        compile_only: chosen only when the kernelize mode includes ``Mode.TORCH_COMPILE``: eagerly the kernel
            would run slower than what it replaces (torchao's FP8 casts are separate, unfused kernels), so a mode
            without it passes the kernel over (and a ``prefer`` naming it raises). Needs
            ``Supports.TORCH_COMPILE``.
    """

    id: str
    kind: str
    variants: tuple[str, ...]
    backend: str
    impl: str
    priority: int = 0
    supports: Supports = Supports.BACKWARD
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    capability: CapabilityRange | None = None
    archs: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    description: str = ""
    native_when_compiled: Mode = Mode(0)
    compile_only: bool = False

    def __post_init__(self) -> None:
        _check_id(self.id, "kernel id")
        _check_name(self.kind, f"kernel {self.id!r}: kind")
        if not self.variants or not all(isinstance(v, str) for v in self.variants):
            raise ValueError(f"kernel {self.id!r}: variants must be a non-empty tuple of strings")
        _check_backend(self.backend, f"kernel {self.id!r}: backend", portable=True)
        _check_ref(self.impl, f"kernel {self.id!r}: impl")
        if not isinstance(self.priority, int):
            raise ValueError(f"kernel {self.id!r}: priority {self.priority!r} must be an int")
        if not isinstance(self.supports, Supports):
            raise ValueError(f"kernel {self.id!r}: supports must be a Supports flag, got {self.supports!r}")
        unknown = set(self.dtypes) - _DTYPES
        if not self.dtypes or unknown:
            raise ValueError(
                f"kernel {self.id!r}: dtypes {sorted(unknown) or '()'} invalid; allowed: {sorted(_DTYPES)}"
            )
        if self.capability is not None and not isinstance(self.capability, CapabilityRange):
            raise ValueError(f"kernel {self.id!r}: capability must be a CapabilityRange or None")
        if not isinstance(self.archs, tuple) or not isinstance(self.requires, tuple):
            raise ValueError(f"kernel {self.id!r}: archs and requires must be tuples")
        for requirement in self.requires:
            _parse_requirement(requirement, self.id)
        native = self.native_when_compiled
        if not isinstance(native, Mode) or (native and not (
                Mode.TORCH_COMPILE in native and native & (Mode.INFERENCE | Mode.TRAINING))):
            raise ValueError(f"kernel {self.id!r}: native_when_compiled must be a Mode combining TORCH_COMPILE with "
                             f"INFERENCE and/or TRAINING, or Mode(0); got {native!r}")
        if native and Supports.TORCH_COMPILE not in self.supports:
            raise ValueError(f"kernel {self.id!r}: native_when_compiled needs Supports.TORCH_COMPILE in supports")
        if not isinstance(self.compile_only, bool):
            raise ValueError(f"kernel {self.id!r}: compile_only must be a bool, got {self.compile_only!r}")
        if self.compile_only and Supports.TORCH_COMPILE not in self.supports:
            raise ValueError(f"kernel {self.id!r}: compile_only needs Supports.TORCH_COMPILE in supports")

    def left_to_compiler(self, mode: Mode) -> bool:
        """Whether kernelize in ``mode`` leaves this kernel's modules to torch.compile (see ``native_when_compiled``).

        Example:
            >>> spec = KernelSpec(id="cuda.rms_norm.x", kind="rms_norm", variants=("standard",), backend="cuda",
            ...                   impl="pkg.ops:rms_norm", supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
            ...                   native_when_compiled=Mode.INFERENCE | Mode.TORCH_COMPILE)
            >>> spec.left_to_compiler(Mode.INFERENCE | Mode.TORCH_COMPILE), spec.left_to_compiler(Mode.INFERENCE)
            (True, False)
        """
        return Mode.TORCH_COMPILE in mode and mode in self.native_when_compiled

    @property
    def portable(self) -> bool:
        return self.backend == ANY_BACKEND


def _naming_init(cls: type) -> None:
    """Give ``cls`` (a frozen dataclass with an ``id`` field) an ``__init__`` whose errors name the kernel and the
    field, with the closest field for an unknown keyword, and that marks rather than raises under :func:`declaring`."""
    generated = cls.__dict__["__init__"]
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kernel = kwargs.get("id", args[0] if args else None)
        problem = None
        unknown = [key for key in kwargs if key not in names]
        if unknown:
            hints = [f"{key!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
                key, names, 1)) else "") for key in unknown]
            problem = (f"kernel {kernel!r}: {cls.__name__} has no field {', '.join(hints)}" if len(unknown) == 1
                       else f"kernel {kernel!r}: {cls.__name__} has no fields {', '.join(hints)}")
            if not _DECLARING.get():
                raise TypeError(f"{problem}; its fields: {', '.join(names)}")
            kwargs = {key: value for key, value in kwargs.items() if key in names}
        try:
            generated(self, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            if not _DECLARING.get():
                raise
            problem = problem or (str(exc) if str(exc).startswith("kernel ") else f"kernel {kernel!r}: {exc}")
        if problem is not None:
            # Fields a failed __init__ did not set get their default, so that listings can still show the kernel.
            for f in fields:
                if f.name not in self.__dict__:
                    default = f.default if f.default is not dataclasses.MISSING else (
                        f.default_factory() if f.default_factory is not dataclasses.MISSING else "?")
                    object.__setattr__(self, f.name, default)
            object.__setattr__(self, _PROBLEM_ATTR, problem)

    cls.__init__ = __init__  # type: ignore[misc]


_naming_init(KernelSpec)


def _parse_requirement(requirement: str, kernel_id: str) -> object:
    from packaging.requirements import InvalidRequirement
    from packaging.requirements import Requirement

    try:
        return Requirement(requirement)
    except InvalidRequirement as exc:
        raise ValueError(f"kernel {kernel_id!r}: requirement {requirement!r} is not PEP 508: {exc}") from None


@dataclass(frozen=True)
class Binding:
    """What a bind hook returns: the instance attributes to set on one module.

    The core sets them and records what they replaced, so every binding is undone exactly by
    :func:`kernels_core.unkernelize` and rolled back if a later binding in the same call fails.
    """

    attributes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.attributes, dict) or not all(isinstance(k, str) for k in self.attributes):
            raise ValueError("Binding.attributes must be a dict keyed by attribute name")


@dataclass(frozen=True)
class Match(Persisted):
    """A matcher's verdict that a module computes a layer kind's math, in one variant.

    Args:
        kind: the layer kind name.
        variant: one of the kind's variants.
        params: what the kind's adapter needs to call a kernel (epsilon, offset, casting, ...); plain values.
        evidence: why the matcher is sure, for the report (``"probe matched offset reference"``).
        bypasses: sub-modules, by dotted name relative to the matched module, whose forward the kind's kernel
            computes itself and never calls, whatever the inputs (a decoder layer's fused residual add + norm
            never calls ``post_attention_layernorm``). While that kernel is bound they and their own sub-modules
            get no kernel of their own and are reported as covered by it. A sub-module the kernel calls on some
            paths only (an original forward it falls back to) is not listed.
    """

    kind: str
    variant: str
    params: dict[str, object] = field(default_factory=dict)
    evidence: str = ""
    bypasses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name(self.kind, "match kind")
        if not isinstance(self.variant, str) or not self.variant:
            raise ValueError("match variant must be a non-empty string")
        if not isinstance(self.bypasses, tuple) or not all(isinstance(n, str) and n for n in self.bypasses):
            raise ValueError(f"match bypasses {self.bypasses!r} must be a tuple of sub-module names")


@dataclass(frozen=True)
class Decline:
    """A matcher's verdict that a module looks like a layer kind but must be left alone, and why.

    ``unrecognized`` says the matcher could not read the module's code as any form it knows (a verdict on the code,
    not on the math): on a model family kernels-core is verified on, that is usually a new transformers release,
    and kernelize warns about it once.

    Example:
        >>> Decline("causal_lm_loss", "forward is not a standard causal-LM template", unrecognized=True).kind
        'causal_lm_loss'
    """

    kind: str
    reason: str
    unrecognized: bool = False

    def __post_init__(self) -> None:
        _check_name(self.kind, "decline kind")
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError("a Decline needs a reason")
        if not isinstance(self.unrecognized, bool):
            raise ValueError(f"Decline.unrecognized must be a bool, not {type(self.unrecognized).__name__}")


def _output_tensors(output: Any) -> tuple[Any, ...]:
    """The tensors of a forward's output: itself, or the tensors of a tuple (first level)."""
    import torch

    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)):
        return tuple(t for t in output if isinstance(t, torch.Tensor))
    raise TypeError(f"forward returned {type(output).__name__}; give the case an `outputs` function")


@dataclass(frozen=True)
class ConformanceCase:
    """One module of a layer kind on which every kernel of the kind must reproduce the module's own forward.

    Example:
        >>> import torch
        >>> case = ConformanceCase("standard", "LayerNorm(37)",
        ...                        build=lambda device, dtype: (torch.nn.LayerNorm(37).to(device, dtype), ""),
        ...                        inputs=lambda target, gen: ((torch.randn(3, 37, generator=gen),), {}))
        >>> case.variant
        'standard'

    Args:
        variant: the kind's variant the module computes; the kind's matcher must report it.
        name: shown in the check's table (``"LlamaRMSNorm(37)"``).
        build: ``build(device, dtype) -> (root, target)``: a module tree on ``device`` in ``dtype``, and the
            qualified name of the module of the kind inside it (``""`` for the root). The root is what the
            matcher sees as the model (rotary sizes, configuration).
        inputs: ``inputs(target, generator) -> (args, kwargs)`` for the target's forward, drawn from the CPU
            ``generator`` and placed on the target's device. Floating-point tensors among the top-level
            arguments get gradients when the kernel declares a backward.
        outputs: ``outputs(result) -> tuple of tensors`` to compare; by default the result itself, or the
            tensors of a returned tuple.
        factor: the case's bound is ``factor * tolerance(dtype)``; above 1 where the kernel's rounding passes
            through further layers before the compared outputs (a decoder layer, a whole model).
        edge_rows: the check replaces rows of the floating-point positional inputs (the last dimension being a row)
            with the values real models feed: an all-zero row, a row scaled to 1e-3 and one scaled by 64, so that
            a kernel that forgets an epsilon or overflows an intermediate fails. ``False`` for inputs where such
            rows are not valid (probabilities, indices stored as floats).
    """

    variant: str
    name: str
    build: Callable[[Any, Any], tuple[Any, str]]
    inputs: Callable[[Any, Any], tuple[tuple[Any, ...], dict[str, Any]]]
    outputs: Callable[[Any], tuple[Any, ...]] = _output_tensors
    factor: float = 1.0
    edge_rows: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.variant, str) or not self.variant:
            raise ValueError(f"conformance case {self.name!r}: variant must be a non-empty string")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a conformance case needs a name")
        for what in ("build", "inputs", "outputs"):
            if not callable(getattr(self, what)):
                raise ValueError(f"conformance case {self.name!r}: {what} must be callable")
        if not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise ValueError(f"conformance case {self.name!r}: factor {self.factor!r} must be a positive number")
