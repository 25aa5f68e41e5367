"""Everything a kernels-core plugin is written against: its hooks, declarations, matcher context and helpers.

A plugin is a module advertised under the ``kernels_core.plugins`` entry-point group. It implements some of the
:class:`Hooks` with :data:`hookimpl`, returns the declarations below (:class:`KernelSpec`, :class:`LayerKind`,
:class:`BackendInfo`...), and states in ``KERNELS_CORE_PLUGIN_API`` the version of this API it was written for
(see :data:`PLUGIN_API_VERSION`). A plugin that adds a layer kind also writes a :class:`Matcher` (which receives a
:class:`MatchContext`), an :class:`Adapter` and, for ``kernels-core check``, :class:`ConformanceCase` values.
Nothing here imports torch until :class:`MatchContext` or :class:`ConformanceCase` is first used.

Example:
    >>> from kernels_core.plugin import KernelSpec, Supports, hookimpl
    >>> KERNELS_CORE_PLUGIN_API = "1.0"
    >>> @hookimpl
    ... def kernels_core_kernels():
    ...     return [KernelSpec(id="acme.rms_norm.fused", kind="rms_norm", variants=("standard",), backend="acme",
    ...                        impl="kernels_acme._ops:rms_norm", priority=100, supports=Supports.BACKWARD)]
    >>> kernels_core_kernels()[0].id
    'acme.rms_norm.fused'
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple
from typing import Protocol

import pluggy

from ._types import BackendInfo
from ._types import Binding
from ._types import CapabilityRange
from ._types import Decline
from ._types import DeviceInfo
from ._types import KernelSpec
from ._types import LayerKind
from ._types import Match
from ._types import Mode
from ._types import Supports


if TYPE_CHECKING:
    import torch
    from torch import nn

    from ._check import ConformanceCase
    from ._kinds._context import MatchContext

__all__ = [
    "API_ATTRIBUTE",
    "PLUGIN_API_VERSION",
    "TOLERANCES",
    "Adapter",
    "BackendInfo",
    "Binding",
    "CapabilityRange",
    "ConformanceCase",
    "ConformanceCases",
    "Decline",
    "DeviceInfo",
    "Hooks",
    "KernelSpec",
    "LayerKind",
    "Match",
    "MatchContext",
    "Matcher",
    "Mode",
    "Supports",
    "Tolerance",
    "hookimpl",
    "kernel_tolerance",
    "probe_close",
    "probe_tolerance",
    "rel_error",
]

PLUGIN_API_VERSION = "1.0"
"""The version of this API, ``"MAJOR.MINOR"``. A minor release only adds to it; a new major one changes or removes
something a plugin may rely on. A plugin states the version it was written for in a module attribute named
:data:`API_ATTRIBUTE` of its entry-point module (``KERNELS_CORE_PLUGIN_API = "1.0"``). kernels-core loads a plugin
stating any ``1.x``, and one stating nothing as written for ``1.0``; one stating another major version (or no
``"MAJOR.MINOR"`` string) is refused: ``kernels-core plugins`` lists it with status ``refused`` and the reason, one
warning is logged, and none of its hooks is called (with ``KERNELS_CORE_STRICT_PLUGINS=1``,
:class:`~kernels_core.PluginError` is raised instead)."""

API_ATTRIBUTE = "KERNELS_CORE_PLUGIN_API"
"""The name of the entry-point module's attribute stating the plugin API version (see :data:`PLUGIN_API_VERSION`)."""

PROJECT_NAME = "kernels_core"
_hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a function (or method) of a plugin as the implementation of one of the :class:`Hooks`. pluggy's options
apply: ``tryfirst``/``trylast`` order the calls, ``wrapper=True`` wraps the other implementations, ``specname``
names the hook when the function is named otherwise. The old-style ``hookwrapper=True`` is refused."""


class Hooks:
    """The hooks a plugin implements, all optional. The core calls them through pluggy.

    The three declaration hooks (:meth:`kernels_core_detect_devices`, :meth:`kernels_core_layer_kinds`,
    :meth:`kernels_core_kernels`) are called once per plugin manager, their results cached. Each returns a list
    (an empty one when there is nothing to declare). Every plugin's implementation is called, as pluggy does, with
    one difference: an implementation that raises, or returns something other than a list of the hook's type, gives
    no result and its plugin is skipped (warned once, naming the plugin and its distribution), while the others'
    results still come back. ``None`` (usually a forgotten ``return``) declares nothing and is warned about; a
    single value not wrapped in a list skips the plugin.

    pluggy's ordering applies to these calls: ``tryfirst=True`` implementations run first, ``trylast=True`` ones
    last, and their lists come back in that order. A hook wrapper (``@hookimpl(wrapper=True)``, a generator that
    yields once) receives that list of lists at its ``yield`` and returns it, edited or not: an entry it removes is
    not declared, an entry it adds or replaces counts as declared by the wrapper's plugin. A wrapper that raises or
    returns something else is skipped like a raising implementation, and the results it was sent stand. What the
    order never decides is which kernel a module gets: that is data (priority, then plugin name, then kernel id);
    a clash between two plugins' layer kinds keeps the core's kind, else that of the plugin whose name sorts first.

    Example:
        >>> from kernels_core.plugin import hookimpl
        >>> @hookimpl(wrapper=True)
        ... def kernels_core_kernels():
        ...     results = yield  # one list per implementation, in call order
        ...     return [[spec for spec in specs if spec.backend != "cpu"] for specs in results]
    """

    @_hookspec
    def kernels_core_detect_devices(self) -> Iterable[BackendInfo]:
        """Report the backends this plugin can drive and the devices present for each.

        Must be cheap and never raise: import the vendor runtime lazily, and when the hardware or runtime is
        missing return a :class:`BackendInfo` with no devices and the reason, logging it at DEBUG. Reporting the
        backend even without devices matters: ``kernels-core kernels`` marks a kernel whose backend no installed
        plugin reports as ``undetectable backend`` (it can never be chosen). Must not import kernel code (Triton,
        Liger, fused-op libraries).

        Example:
            >>> from kernels_core.plugin import BackendInfo, DeviceInfo, hookimpl
            >>> @hookimpl
            ... def kernels_core_detect_devices():
            ...     return [BackendInfo(backend="cpu", device_type="cpu", devices=(DeviceInfo(0, "host"),))]
        """

    @_hookspec
    def kernels_core_layer_kinds(self) -> Iterable[LayerKind]:
        """Declare layer kinds (families of layers sharing one piece of math) this plugin adds.

        The core declares the kinds transformers models need; a plugin adds a kind only for math the core does
        not know. Matchers and adapters are lazy ``module:attr`` references, loaded by kernelize: a kind whose
        matcher or adapter does not load is not used (its modules keep their own forward), with a
        :class:`~kernels_core.KernelFallbackWarning` and a report row naming the plugin, the kind and the
        reference; strict kernelize raises instead.
        """

    @_hookspec
    def kernels_core_kernels(self) -> Iterable[KernelSpec]:
        """Declare the kernels this plugin offers, as :class:`KernelSpec` values.

        Listing must import no kernel module: ``KernelSpec.impl`` is a lazy reference resolved only when kernelize
        chooses the kernel; if it does not load, kernelize falls back to the next candidate and issues a
        :class:`~kernels_core.KernelFallbackWarning` once per kernel and process. ``variants`` must be variants
        the kind declares (a kernel naming another is rejected with the allowed names); ``backend`` is a backend
        name some installed plugin's :meth:`kernels_core_detect_devices` reports, or ``"any"``.

        Example:
            >>> from kernels_core.plugin import KernelSpec, Supports, hookimpl
            >>> @hookimpl
            ... def kernels_core_kernels():
            ...     return [KernelSpec(id="cpu.rms_norm.mine", kind="rms_norm", variants=("standard",),
            ...                        backend="cpu", impl="my_plugin.ops:rms_norm", supports=Supports.BACKWARD)]
        """

    @_hookspec(firstresult=True)
    def kernels_core_bind_kernel(self, module: nn.Module, match: Match, kernel: KernelSpec,
                                 forward: Callable[..., Any]) -> Binding | None:
        """Decide how a kernel kernelize chose is attached to one module instance.

        kernelize calls this hook through pluggy for every module it binds a forward kernel to, on the
        implementations of the plugin that declared ``kernel`` alone (its wrappers included): no plugin decides
        how another plugin's kernels are attached. ``firstresult``: the first :class:`Binding` returned wins.
        ``None``, or no implementation, keeps the core's default, ``Binding({"forward": forward})``.

        Args:
            module: the module instance being bound.
            match: its matcher's verdict (:class:`Match`).
            kernel: the chosen kernel's declaration.
            forward: the per-instance forward the core built for this kernel from the kind's adapter; picklable,
                and undone by ``unkernelize``.

        Returns:
            A :class:`Binding` of the instance attributes to set, or ``None``. The core sets them itself and
            records what they replace, so bindings stay atomic and reversible; they may not replace parameters,
            buffers or sub-modules. A raising implementation fails kernelize with
            :class:`~kernels_core.KernelizeError` naming the plugin, leaving the model as it was.
        """


class Matcher(Protocol):
    """What a :class:`LayerKind`'s ``matcher`` reference points at: ``match(module, name, ctx)``.

    kernelize calls it for every module of the model (``name`` is its qualified name, ``""`` for the root) and
    ``kernels-core check`` for each conformance case. Return ``None`` for a module that is not a candidate,
    :class:`Decline` (with the reason, shown in the report) for one that looks like the kind but whose math cannot
    be confirmed, and :class:`Match` once the math is verified, ideally by probing ``ctx.original_forward(module)``
    with ``ctx.run_probe`` inside ``ctx.verdict`` (see :class:`MatchContext`). A matcher must not change the
    module, nor seed or draw from torch's global generators. Exceptions are caught: the module keeps its forward
    and the report names the matcher.
    """

    def __call__(self, module: nn.Module, name: str, ctx: MatchContext, /) -> Match | Decline | None: ...


class Adapter(Protocol):
    """What a :class:`LayerKind`'s ``adapter`` reference points at: ``adapt(module, match, impl, options)``.

    ``impl`` is the chosen kernel's implementation (its ``KernelSpec.impl``, loaded), following the kind's calling
    convention; ``options`` are the user's ``[kinds.<name>] options``, checked against ``LayerKind.options``. For a
    ``target="forward"`` kind, return the module's new forward (called with the arguments of the module's own);
    for a ``target="global"`` kind, the replacement of the global function ``match.params["global_name"]``, which
    must depend on the module's class only (replacements are shared between layers with identical matches).
    """

    def __call__(self, module: nn.Module, match: Match, impl: Callable[..., Any], options: dict[str, Any], /
                 ) -> Callable[..., Any]: ...


class ConformanceCases(Protocol):
    """What a :class:`LayerKind`'s ``conformance`` reference points at: ``cases()`` returning
    :class:`ConformanceCase` values, small real modules on which every kernel of the kind is checked."""

    def __call__(self) -> Iterable[ConformanceCase]: ...


class Tolerance(NamedTuple):
    """Relative-error bounds (``max|a - b| / max|b|``) of one dtype: ``probe``, below which a matcher's probe counts
    as the module computing the reference math (:func:`probe_tolerance`), and ``kernel``, for a kernel against the
    eager module it replaces (``kernels-core check``, ``kernels_core.testing.assert_close``)."""

    probe: float
    kernel: float


TOLERANCES: Mapping[str, Tolerance] = MappingProxyType({
    "float64": Tolerance(probe=1e-8, kernel=1e-10),
    "float32": Tolerance(probe=1e-4, kernel=2e-5),
    "float16": Tolerance(probe=4e-3, kernel=4e-3),
    "bfloat16": Tolerance(probe=3e-2, kernel=2e-2),
})
"""The relative-error bounds of each dtype, by torch name, read by the core's matchers and checks alike.

``probe`` is generous enough for a module computing in another order than the reference, and tight enough that a
(1 + w) offset, another activation or a missing multiplier (errors of order 1) never passes. ``kernel``: bf16 keeps
8 mantissa bits (eps 2^-8 = 3.9e-3) and fp16 11 (eps 9.8e-4); a kernel that reduces in another order or keeps an
fp32 intermediate the eager code rounds differs by a few ulps of the output, so the bounds are a few eps; fp32
differences come from reduction order only."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def probe_tolerance(dtype: torch.dtype | str) -> float:
    """The relative error below which a probe of a module in ``dtype`` counts as the reference math (3e-2 for a
    dtype not in :data:`TOLERANCES`).

    Example:
        >>> probe_tolerance("bfloat16") > probe_tolerance("float32")
        True
    """
    bounds = TOLERANCES.get(_dtype_name(dtype))
    return bounds.probe if bounds is not None else 3e-2


def kernel_tolerance(dtype: torch.dtype | str) -> float:
    """The relative error a kernel may show against the eager module in ``dtype``; ``KeyError`` for another dtype.

    Example:
        >>> kernel_tolerance("float32")
        2e-05
    """
    return TOLERANCES[_dtype_name(dtype)].kernel


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|``, computed in float64.

    Example:
        >>> import torch
        >>> rel_error(torch.tensor([1.0, 2.02]), torch.tensor([1.0, 2.0]))  # doctest: +ELLIPSIS
        0.00999...
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


def probe_close(actual: object, expected: torch.Tensor, dtype: torch.dtype | str) -> bool:
    """Whether a probe's output ``actual`` is the reference ``expected``: a tensor of the same shape and dtype, all
    finite, within :func:`probe_tolerance` of ``dtype`` (the module's parameter dtype).

    The dtype is part of the math: a kernel returns what the reference returns, and a module whose output dtype
    differs (a float32 result from a bfloat16 input) would break the next layer if its kernel did not.

    Example:
        >>> import torch
        >>> ones = torch.ones(3)
        >>> probe_close(ones, ones, torch.float32), probe_close(ones.double(), ones, "float32")
        (True, False)
    """
    import torch

    return (
        isinstance(actual, torch.Tensor)
        and actual.shape == expected.shape
        and actual.dtype == expected.dtype
        and bool(torch.isfinite(actual).all())
        and rel_error(actual, expected) <= probe_tolerance(dtype)
    )


def __getattr__(name: str) -> Any:
    # These import torch: loaded on first use, so that a plugin's declarations module stays cheap to import.
    if name == "MatchContext":
        from ._kinds._context import MatchContext

        return MatchContext
    if name == "ConformanceCase":
        from ._check import ConformanceCase

        return ConformanceCase
    raise AttributeError(f"module 'kernels_core.plugin' has no attribute {name!r}")
