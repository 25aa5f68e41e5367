"""What fell back in this process: each kernel (or layer kind) an automatic choice passed over, and why, warned about
once per cause with a :class:`~kernels_core.KernelFallbackWarning`; ``kernels-core kernels`` lists them."""

from __future__ import annotations

import threading
import warnings

from .._errors import KernelFallbackWarning
from .._hints import user_stacklevel
from ._records import PluginInfo
from ._records import ProvidedKernel


__all__ = ["note_fallback", "recorded_fallbacks", "reset_fallbacks", "warn_fallback"]


# Process-wide: what fell back and why, for listings; which (plugin, subject, cause) were already warned about.
_FALLBACKS: dict[tuple[str, str], str] = {}
_WARNED: set[tuple[str, str, str]] = set()
_FALLBACK_LOCK = threading.Lock()


def warn_fallback(plugin: PluginInfo, subject: str, cause: str, message: str) -> None:
    """Record that ``subject`` (a kernel id, or ``kind:<name>``) of ``plugin`` fell back; warn once per cause."""
    key = (plugin.name, subject, cause)
    with _FALLBACK_LOCK:
        _FALLBACKS[(plugin.name, subject)] = cause
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, KernelFallbackWarning, stacklevel=user_stacklevel())


def note_fallback(provided: ProvidedKernel, cause: str) -> None:
    """Record and warn (once per kernel and cause, per process) that an automatic choice passed a kernel over."""
    spec, plugin = provided.spec, provided.plugin
    fix = f"reinstall or fix {plugin.distribution}" if plugin.distribution else f"fix plugin {plugin.name!r}"
    warn_fallback(plugin, spec.id, cause,
                  f"kernel {spec.id!r} of plugin {plugin.name!r} ({plugin.origin}) cannot be used, so the next "
                  f"candidate runs instead: {cause}. To fix it, {fix}; to stop trying it, set "
                  f'kernels.disable = ["{spec.id}"] in kernels.toml')


def recorded_fallbacks() -> dict[tuple[str, str], str]:
    """``(plugin, kernel id or kind:<name>) -> cause`` for every fallback seen in this process."""
    with _FALLBACK_LOCK:
        return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget recorded fallbacks and warnings (tests: each test starts as a fresh process would)."""
    with _FALLBACK_LOCK:
        _FALLBACKS.clear()
        _WARNED.clear()
