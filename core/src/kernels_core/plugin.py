"""Everything a kernels-core plugin is written against: its hooks, declarations, matcher context and helpers.

A plugin is a module advertised under the ``kernels_core.plugins`` entry-point group. It implements some of the
:class:`Hooks` with :data:`hookimpl`, returns the declarations below (:class:`KernelSpec`, :class:`LayerKind`,
:class:`BackendInfo`...), and states in ``KERNELS_CORE_PLUGIN_API`` the version of this API it was written for
(see :data:`PLUGIN_API_VERSION`). A plugin that adds a layer kind also writes a :class:`Matcher` (which receives a
:class:`MatchContext`), an :class:`Adapter` and, for ``kernels-core check``, :class:`ConformanceCase` values.
Nothing here imports torch until :class:`MatchContext` is first used.

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
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from ._plugins._hookspec import API_ATTRIBUTE
from ._plugins._hookspec import PLUGIN_API_VERSION
from ._plugins._hookspec import Hooks
from ._plugins._hookspec import hookimpl
from ._tolerance import TOLERANCES
from ._tolerance import Tolerance
from ._tolerance import kernel_tolerance
from ._tolerance import probe_close
from ._tolerance import probe_tolerance
from ._tolerance import rel_error
from ._types import BackendInfo
from ._types import Binding
from ._types import CapabilityRange
from ._types import ConformanceCase
from ._types import Decline
from ._types import DeviceInfo
from ._types import KernelSpec
from ._types import LayerKind
from ._types import Match
from ._types import Mode
from ._types import Supports


if TYPE_CHECKING:
    from torch import nn

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


def __getattr__(name: str) -> Any:
    # The matcher context imports torch: loaded on first use, so that a declarations module stays cheap to import.
    if name == "MatchContext":
        from ._kinds._context import MatchContext

        return MatchContext
    raise AttributeError(f"module 'kernels_core.plugin' has no attribute {name!r}")
