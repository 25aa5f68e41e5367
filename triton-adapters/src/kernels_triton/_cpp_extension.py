"""The C++ autograd extension (``_autograd_ext.cpp``): built once per machine and torch version, in the background.

The RMSNorm kernels' Python ``autograd.Function`` costs 50-70 us of host time per backward in the autograd
engine's device thread (H200 host, ``benchmarks/results/cuda-rmsnorm-h200-pinning.txt`` at commit d5757ef): below ~33M elements
more than the GPU time of the whole layer. The extension moves those autograd nodes to C++; the kernels, their
compiled binaries and the launch shapes stay exactly the Python path's, so results are bit-identical.

The build needs a C++ compiler and ``ninja`` (a dependency of kernels-cuda) and takes about a minute the first
time; torch caches it under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), so later processes
only load it. It runs in a background thread started by the first call that could use it: until it is ready, or
if it cannot be built (the warning says why), the Python autograd path runs. ``KERNELS_TRITON_CPP_AUTOGRAD=0``
turns it off; ROCm builds of torch never use it (the launch goes through the CUDA driver).

Example:
    >>> from kernels_triton import _cpp_extension
    >>> _cpp_extension.status() in {"not started", "disabled", "building", "ready", "failed"}
    True
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import threading
from types import ModuleType


__all__ = ["ENV_SWITCH", "arg_types", "extension", "failure", "give_up", "load_extension", "status"]

ENV_SWITCH = "KERNELS_TRITON_CPP_AUTOGRAD"

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).with_name("_autograd_ext.cpp")
_lock = threading.Lock()
_load_lock = threading.Lock()
_loaded: ModuleType | None = None
_thread: threading.Thread | None = None
_module: ModuleType | None = None
_failure: str | None = None


def _disabled_reason() -> str | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    import torch

    if torch.version.hip is not None:
        return "ROCm build of torch (the extension launches through the CUDA driver)"
    if torch.version.cuda is None:
        return "torch has no CUDA"
    return None


def load_extension() -> ModuleType:
    """Build (or load the cached build of) the extension now, in this thread; raises what the build raises.

    Example:
        >>> load_extension  # doctest: +ELLIPSIS
        <function load_extension at ...>
    """
    global _loaded
    with _load_lock:
        # Once per process: loading the library a second time would register its pybind11 types again over the
        # first load's, and the objects made from those would no longer convert.
        if _loaded is None:
            from torch.utils import cpp_extension

            source = _SOURCE.read_bytes()
            # The name carries the source's hash: an edited source builds anew instead of loading a stale binary.
            name = "kernels_triton_autograd_" + hashlib.sha256(source).hexdigest()[:12]
            logger.info("kernels-triton: building or loading the C++ autograd extension %s", name)
            _loaded = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
        return _loaded


def _build() -> None:
    global _module, _failure
    try:
        _module = load_extension()
        logger.info("kernels-triton: C++ autograd extension ready")
    except Exception as error:  # noqa: BLE001 - any build failure leaves the (working) Python path in place
        _failure = f"{type(error).__name__}: {error}"
        logger.warning("kernels-triton: the C++ autograd extension could not be built (%s); RMSNorm backward "
                       "runs as a Python autograd node", _failure.splitlines()[0])


def extension(*, wait: bool = False) -> ModuleType | None:
    """The loaded extension, or None while it builds, when it failed or is disabled.

    The first call starts the build in a background thread; ``wait=True`` blocks until it has finished.
    """
    global _thread, _failure
    if _module is not None:
        return _module
    if _failure is not None:
        return None
    with _lock:
        if _thread is None:
            reason = _disabled_reason()
            if reason is not None:
                _failure = f"disabled: {reason}"
                logger.info("kernels-triton: C++ autograd extension not used (%s)", reason)
                return None
            _thread = threading.Thread(target=_build, name="kernels-triton-cpp-build", daemon=True)
            _thread.start()
    if wait:
        _thread.join()
    return _module


def give_up(error: BaseException) -> None:
    """Stop using the extension for the rest of the process after a call through it failed; the Python autograd
    path runs from the next call on (the failed call falls back to it too), and one warning says why.

    Example:
        >>> give_up  # doctest: +ELLIPSIS
        <function give_up at ...>
    """
    global _module, _failure
    _failure = f"a call failed: {type(error).__name__}: {error}"
    _module = None
    logger.warning("kernels-triton: the C++ autograd path failed (%s); using the Python autograd path from now on",
                   _failure.splitlines()[0])


def status() -> str:
    """``not started``, ``disabled``, ``building``, ``ready`` or ``failed`` (:func:`failure` says why)."""
    if _module is not None:
        return "ready"
    if _failure is not None:
        return "disabled" if _failure.startswith("disabled:") else "failed"
    return "not started" if _thread is None else "building"


def failure() -> str | None:
    """Why the extension is not used (build error or the switch that disabled it), or None."""
    return _failure


# Triton's CUDA launcher passes these argument types as one parameter slot each (Triton 3.3-3.9).
_ARG_LETTERS = {"i32": "i", "i64": "l", "fp32": "f"}


def arg_types(compiled: object) -> str | None:
    """One letter per argument the compiled Triton kernel takes at launch (see ``_autograd_ext.cpp``), or None
    when its launch is not the plain one the extension reproduces (clusters, scratch memory, cooperative or
    programmatic-dependent launch, tensor descriptors, instrumentation).

    Example:
        >>> from types import SimpleNamespace
        >>> src = SimpleNamespace(signature={"X": "*bf16", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"})
        >>> meta = SimpleNamespace(num_ctas=1, global_scratch_size=0, profile_scratch_size=0,
        ...                        launch_cooperative_grid=False, launch_pdl=False)
        >>> arg_types(SimpleNamespace(src=src, metadata=meta))
        'pif'
    """
    metadata = compiled.metadata  # type: ignore[attr-defined]
    plain = (getattr(metadata, "num_ctas", 1) == 1
             and not getattr(metadata, "global_scratch_size", 0)
             and not getattr(metadata, "profile_scratch_size", 0)
             and not getattr(metadata, "launch_cooperative_grid", False)
             and not getattr(metadata, "launch_pdl", False)
             and not getattr(metadata, "instrumentation_mode", ""))
    if not plain:
        return None
    letters = []
    for kind in compiled.src.signature.values():  # type: ignore[attr-defined]
        if kind == "constexpr":
            continue
        if not isinstance(kind, str):
            return None
        letter = "p" if kind.startswith("*") else _ARG_LETTERS.get(kind)
        if letter is None:
            return None
        letters.append(letter)
    return "".join(letters)
