"""The hook specifications of kernels-core's plugin API and the plugin API version (published through
:mod:`kernels_core.plugin`, which documents them; kept here so the core's own modules never import the public
facade, which re-exports the matcher context and so would close an import cycle).

Example:
    >>> from kernels_core._plugins._hookspec import PLUGIN_API_VERSION
    >>> PLUGIN_API_VERSION.count(".")
    1
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import TYPE_CHECKING
from typing import Any

import pluggy

from .._types import BackendInfo
from .._types import Binding
from .._types import KernelSpec
from .._types import LayerKind
from .._types import Match


if TYPE_CHECKING:
    from torch import nn

__all__ = ["API_ATTRIBUTE", "PLUGIN_API_VERSION", "PROJECT_NAME", "Hooks", "hookimpl"]

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
            forward: the per-instance forward the core built for this kernel from the kind's adapter, a method
                (torch.compile then guards it by its code, not per instance); picklable, and undone by
                ``unkernelize``.

        Returns:
            A :class:`Binding` of the instance attributes to set, or ``None``. The core sets them itself and
            records what they replace, so bindings stay atomic and reversible; they may not replace parameters,
            buffers or sub-modules. A raising implementation fails kernelize with
            :class:`~kernels_core.KernelizeError` naming the plugin, leaving the model as it was.
        """
