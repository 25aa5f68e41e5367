"""Lazy, failure-tolerant access to ``torch_npu``.

``import torch_npu`` fails in more ways than "module not found": without CANN it raises ``ImportError``
(``libhccl.so: cannot open shared object file``), a CANN/torch version mismatch raises ``ImportError``
(``undefined symbol``), and on a CUDA build of torch it raises ``RuntimeError`` ("Two accelerators cannot be used
at the same time in PyTorch"). Every one of those means "no NPU here", so the import is attempted once, inside a
function, catching ``Exception``, and the outcome (module or reason) is remembered.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType


__all__ = ["TorchNpuUnavailable", "clear_cache", "load_torch_npu", "unavailable_reason"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# None: not tried yet; a module: imported; a str: why it could not be imported.
_outcome: ModuleType | str | None = None


class TorchNpuUnavailable(RuntimeError):
    """Raised by :func:`load_torch_npu` when ``torch_npu`` cannot be used on this host; the message says why."""


def _try_import() -> ModuleType | str:
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError and the "two accelerators" RuntimeError alike
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"import torch_npu failed: {type(exc).__name__}: {first_line}".rstrip(": ")


def _outcome_once() -> ModuleType | str:
    global _outcome
    if _outcome is None:
        with _lock:
            if _outcome is None:
                _outcome = _try_import()
                if isinstance(_outcome, str):
                    logger.debug("torch_npu unavailable: %s", _outcome)
    return _outcome


def load_torch_npu() -> ModuleType:
    """Return the ``torch_npu`` module, importing it on first use.

    Raises:
        TorchNpuUnavailable: when it is not installed or fails to import; the message carries the original error.

    Example:
        >>> from kernels_npu._torch_npu import load_torch_npu, unavailable_reason
        >>> unavailable_reason() is None or unavailable_reason().startswith("import torch_npu failed")
        True
    """
    outcome = _outcome_once()
    if isinstance(outcome, str):
        raise TorchNpuUnavailable(
            f"{outcome}. kernels-npu needs the torch_npu build matching this host's CANN "
            "(pip install 'kernels-npu[ascend]' or your vendor's wheel)."
        )
    return outcome


def unavailable_reason() -> str | None:
    """Why ``torch_npu`` cannot be imported, or ``None`` when it can (imports it on first use, never raises)."""
    outcome = _outcome_once()
    return outcome if isinstance(outcome, str) else None


def clear_cache() -> None:
    """Forget the remembered import outcome, so the next call tries again (for tests and late installs)."""
    global _outcome
    with _lock:
        _outcome = None
