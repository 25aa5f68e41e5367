"""Triton's one-off runtime set-up, done on a background thread as soon as a kernel of this package is bound on a
GPU, so that the model's first step does not wait for it.

Kernelize binds a kernel by resolving its declared reference, ``kernels_triton.ops:<name>``; :mod:`kernels_triton.ops`
calls :func:`start` then, for the kernels that launch Triton or Liger code. Importing a module of this package never
starts the thread.

A kernelized model's first step pays, once per process, for work that eager PyTorch never does: creating Triton's
CUDA driver (an ``ldconfig`` call and loading, or on a new machine compiling, its C helpers), hashing Triton's own
files into its cache key, importing the kernel modules that adapters import only on their first GPU call and
Liger's operators (``liger_kernel.ops`` imports every Liger op). The hash and the subprocesses release the GIL,
so they overlap the caller's own work: building the optimizer and the data, and the first step itself until its
first Triton launch. The imports compete for the GIL, so kernelize itself takes longer; what a user waits for,
kernelize plus the first step, is shorter. H100, Triton's cache filled, 3 alternating rounds against
``KERNELS_TRITON_WARMUP=0`` (``benchmarks/results/first-step-ab-h100.json``): Mixtral-8x7B shape 1.85 s against
2.29 s, Qwen3-30B-A3B 1.94 s against 2.29 s; the first step alone 0.47 s and 0.55 s against 1.55 s and 1.51 s
(eager's: 0.70 s and 0.72 s).

Nothing here changes what runs: each step is one the first launch would otherwise do itself, and a step that
fails is only logged (at debug level), since the launch that needs it raises the same error where it is used.
``KERNELS_TRITON_WARMUP=0`` turns the thread off; without a CUDA or ROCm device nothing starts.

Example:
    >>> import torch
    >>> from kernels_triton import _warmup
    >>> _warmup.start("json") == torch.cuda.is_available()   # a thread only where there is a GPU
    True
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
from collections.abc import Callable


__all__ = ["ENV_SWITCH", "start"]

ENV_SWITCH = "KERNELS_TRITON_WARMUP"

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: queue.SimpleQueue[str] = queue.SimpleQueue()
_queued: set[str] = set()
_thread: threading.Thread | None = None


def _triton_driver() -> None:
    from triton.runtime.driver import driver

    driver.active  # noqa: B018 - the property creates the driver


def _triton_cache_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()  # cached by Triton for the process


def _cpp_autograd() -> None:
    from . import _cpp_extension

    _cpp_extension.extension()  # starts the build (or the cached load) in its own thread


# The runtime steps, queued ahead of any module by the first start(); a name each for the debug log.
_RUNTIME: dict[str, Callable[[], None]] = {
    "triton driver": _triton_driver,
    "triton cache key": _triton_cache_key,
    "C++ autograd extension": _cpp_autograd,
}


def _enabled() -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    import torch

    return torch.cuda.is_available()  # CUDA or ROCm; asks the driver for a count, creates no context


def _work() -> None:
    while True:
        name = _pending.get()
        try:
            step = _RUNTIME.get(name)
            if step is not None:
                step()
            else:
                importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - the launch that needs this step raises the same error there
            logger.debug("kernels-triton: warm-up step %r failed: %s: %s", name, type(error).__name__, error)


def start(*modules: str) -> bool:
    """Queue Triton's runtime set-up (first call only) and the import of ``modules`` on the warm-up thread.

    Returns whether the thread runs: False without a GPU or with ``KERNELS_TRITON_WARMUP=0``. Each step is queued
    once per process; the thread is a daemon and never blocks the caller.
    """
    global _thread
    with _lock:
        if _thread is None:
            if not _enabled():
                return False
            _thread = threading.Thread(target=_work, name="kernels-triton-warmup", daemon=True)
            _thread.start()
            modules = (*_RUNTIME, *modules)
        for name in modules:
            if name not in _queued:
                _queued.add(name)
                _pending.put(name)
    return True
