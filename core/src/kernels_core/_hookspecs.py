"""The hooks a kernels-core plugin implements.

Each hook has one concern. Results are plain frozen data (see :mod:`kernels_core._types`); the core calls every
plugin's implementation separately, so one plugin that raises is skipped without taking the others down, and
ordering between plugins never depends on pluggy's registration order: priority is data.

The three declaration hooks return a list (an empty one when there is nothing to declare). ``None`` (usually a
forgotten ``return``) declares nothing and is warned about; a single value not wrapped in a list skips the plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy


if TYPE_CHECKING:
    from ._types import BackendInfo
    from ._types import Binding
    from ._types import KernelSpec
    from ._types import LayerKind
    from ._types import Match

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "kernels_core"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kernels_core_detect_devices() -> Iterable[BackendInfo]:
    """Report the backends this plugin can drive and the devices present for each.

    Must be cheap and never raise: import the vendor runtime lazily, and when the hardware or runtime is
    missing return a :class:`~kernels_core.BackendInfo` with no devices and the reason, logging it at DEBUG.
    Reporting the backend even without devices matters: ``kernels-core kernels`` marks a kernel whose backend no
    installed plugin reports as ``undetectable backend`` (it can never be chosen). Must not import kernel code
    (Triton, Liger, fused-op libraries).

    Example:
        >>> from kernels_core import BackendInfo, DeviceInfo, hookimpl
        >>> @hookimpl
        ... def kernels_core_detect_devices():
        ...     return [BackendInfo(backend="cpu", device_type="cpu", devices=(DeviceInfo(0, "host"),))]
    """


@hookspec
def kernels_core_layer_kinds() -> Iterable[LayerKind]:
    """Declare layer kinds (families of layers sharing one piece of math) this plugin adds.

    The core declares the kinds transformers models need; a plugin adds a kind only for math the core does not
    know. Matchers and adapters are lazy ``module:attr`` references, loaded by kernelize: a kind whose matcher or
    adapter does not load is not used (its modules keep their own forward), with a
    :class:`~kernels_core.KernelFallbackWarning` and a report row naming the plugin, the kind and the reference;
    strict kernelize raises instead.
    """


@hookspec
def kernels_core_kernels() -> Iterable[KernelSpec]:
    """Declare the kernels this plugin offers, as :class:`~kernels_core.KernelSpec` values.

    Listing must import no kernel module: ``KernelSpec.impl`` is a lazy reference resolved only when kernelize
    chooses the kernel; if it does not load, kernelize falls back to the next candidate and issues a
    :class:`~kernels_core.KernelFallbackWarning` once per kernel and process. ``variants`` must be variants the
    kind declares (a kernel naming another is rejected with the allowed names); ``backend`` is a backend name some
    installed plugin's :func:`kernels_core_detect_devices` reports, or ``"any"``.

    Example:
        >>> from kernels_core import KernelSpec, Supports, hookimpl
        >>> @hookimpl
        ... def kernels_core_kernels():
        ...     return [KernelSpec(id="cpu.rms_norm.mine", kind="rms_norm", variants=("standard",),
        ...                        backend="cpu", impl="my_plugin.ops:rms_norm", supports=Supports.BACKWARD)]
    """


@hookspec(firstresult=True)
def kernels_core_bind_kernel(module: object, match: Match, kernel: KernelSpec, forward: object) -> Binding | None:
    """Decide how a chosen kernel is attached to one module instance.

    ``forward`` is the per-instance forward the core built for this kernel from the kind's adapter. The core's
    default implementation (``trylast``) returns ``Binding({"forward": forward})``. A plugin that must attach
    its own kernels differently returns another :class:`~kernels_core.Binding` for them and ``None`` for every
    kernel it does not own. The core applies the attributes itself and records what they replace, so
    bindings stay atomic and reversible.
    """
