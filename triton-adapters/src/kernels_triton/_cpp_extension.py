"""The norms' C++ autograd nodes (``_autograd_ext.cpp``): built once per machine and torch version in the
background, and the eager path that calls them.

With autograd, the RMSNorm and residual add + RMSNorm run as hand-written ``torch::autograd::Node`` subclasses
launching the same compiled Triton kernels with the same launch shapes as the Python ``autograd.Function`` path
(bit-identical results), through ``cuLaunchKernel`` with the launcher ABI of Triton 3.3-3.9: the Python node costs
tens of microseconds of host time per backward, more than a mid-size norm's GPU time. Kernelized training step,
H100, bf16, batch 4 x 2048, against ``KERNELS_TRITON_CPP_AUTOGRAD=0`` (``benchmarks/results/configs-ab-h100.json``,
runs ``cpp-autograd-qwen3-0.6b`` and ``cpp-autograd``): Qwen3-0.6B (28 layers) 98.3k against 89.9k tokens/s (+9.7%,
median of 6 rounds); Qwen3-30B-A3B shape +3.9%, Gemma-3-4B +1.4%, Llama-3.1-8B 0.0%: it pays where many narrow
norms leave the host setting the pace.

The build (a C++ compiler and ``ninja``; about a minute, then cached by torch under ``TORCH_EXTENSIONS_DIR``) runs
in a background thread started by the first call that could use it. Until it is ready, if it cannot be built (a
warning says why) or once a call through it failed, the Python autograd path runs. A process that exits during
the build leaves torch's build lock behind, on which every later build would wait forever: the builder's PID is
written beside the lock, and a lock whose builder is gone (without a PID: older than half an hour) is removed with
a warning. ``KERNELS_TRITON_CPP_AUTOGRAD=0`` turns the extension off; ROCm builds of torch never use it; a
registered Triton launch hook takes the Python path for that call.

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
import time
from collections.abc import Callable
from types import ModuleType
from types import TracebackType
from typing import Any

import torch

from ._launch import cdiv
from ._launch import launch_hooks_registered
from ._norm_kernels import SUM_TILING
from ._norm_kernels import _add_rms_norm_fwd_kernel
from ._norm_kernels import _rms_norm_bwd_kernel
from ._norm_kernels import _rms_norm_fwd_kernel
from ._norm_kernels import _sum_partials_kernel
from ._norm_kernels import norm_backward_tiling
from ._norm_kernels import norm_tiling


__all__ = ["ENV_SWITCH", "arg_types", "clear_stale_lock", "eager_norm", "extension", "failure", "give_up",
           "load_extension", "norm_call", "python_autograd", "status"]

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
    if torch.version.hip is not None:
        return "ROCm build of torch (the extension launches through the CUDA driver)"
    if torch.version.cuda is None:
        return "torch has no CUDA"
    return None


_BUILDER_FILE = "kernels_triton_builder.pid"
# A build takes about a minute; a lock this old without a builder PID was left by a process that stopped.
_STALE_LOCK_S = 1800.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clear_stale_lock(build_dir: pathlib.Path) -> str | None:
    """Remove torch's build lock in ``build_dir`` if the process that took it is gone; returns why, or None.

    Example:
        >>> import tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> (folder / "lock").touch()
        >>> _ = (folder / _BUILDER_FILE).write_text(str(os.getpid()))  # this process is alive: the lock stays
        >>> clear_stale_lock(folder) is None and (folder / "lock").exists()
        True
    """
    lock = build_dir / "lock"
    if not lock.exists():
        return None
    try:
        pid = int((build_dir / _BUILDER_FILE).read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None:
        if _alive(pid):
            return None
        why = f"its builder, process {pid}, is gone"
    else:
        age = time.time() - lock.stat().st_mtime
        if age < _STALE_LOCK_S:
            return None
        why = f"it is {age / 60:.0f} minutes old and names no builder"
    lock.unlink(missing_ok=True)
    logger.warning("kernels-triton: removed the C++ extension's build lock %s (%s): a process stopped during the "
                   "build; building again", lock, why)
    return why


def load_extension() -> ModuleType:
    """Build (or load the cached build of) the extension now, in this thread; raises what the build raises."""
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
            build_dir = pathlib.Path(cpp_extension._get_build_directory(name, verbose=False))
            clear_stale_lock(build_dir)
            if not (build_dir / "lock").exists():
                # This process is about to build: a later one tells a live build from a lock left behind.
                (build_dir / _BUILDER_FILE).write_text(str(os.getpid()))
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

    Example:
        >>> if torch.version.cuda is None:   # a CPU or ROCm build of torch: never built, nothing started
        ...     assert extension(wait=True) is None and status() == "disabled"
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
    """Use the Python autograd path for the rest of the process after a call through the extension failed."""
    global _module, _failure
    _failure = f"a call failed: {type(error).__name__}: {error}"
    _module = None
    logger.warning("kernels-triton: the C++ autograd path failed (%s); using the Python autograd path from now on",
                   _failure.splitlines()[0])


def status() -> str:
    """``not started``, ``disabled``, ``building``, ``ready`` or ``failed`` (:func:`failure` says why).

    Example:
        >>> status() in {"not started", "disabled", "building", "ready", "failed"}
        True
    """
    if _module is not None:
        return "ready"
    if _failure is not None:
        return "disabled" if _failure.startswith("disabled:") else "failed"
    return "not started" if _thread is None else "building"


def failure() -> str | None:
    """Why the extension is not used (build error or the switch that disabled it), or None.

    Example:
        >>> (failure() is not None) == (status() in {"disabled", "failed"})
        True
    """
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


# ------------------------------------------------------------------------------------------------ the eager path

# Per input signature of an eager norm call with autograd: (extension function, NormCall), or False where the
# Triton kernel does not reproduce the module or the extension cannot take the call. Bounded: row counts vary with
# batch and sequence length.
_ENTRIES: dict[tuple, tuple | bool] = {}
_ENTRIES_MAX = 4096
_NORM_PLANS: dict[tuple, object | None] = {}


def eager_norm(hidden_states: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
               offset: float, casting: str, *,
               supported: Callable[..., bool]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The RMSNorm (with ``residual``: the residual add and norm, and the sum) through the C++ nodes, or None: the
    caller then takes the Python autograd path.

    This runs once per norm layer per training step, and a mid-size layer's GPU time is shorter than the host time
    of the general path's checks: everything that depends only on the input signature (``supported``, the
    compiled kernels, the launch shapes) is looked up in one dictionary; the extension checks the tensors
    themselves (contiguity, 16-byte alignment, the weight's width and device) and declines what its kernels do
    not take. CPU tensors never start the build.
    """
    key = (hidden_states.shape, hidden_states.dtype, weight.dtype, hidden_states.get_device(), casting, offset != 0.0)
    if residual is not None:
        key += (residual.shape, residual.dtype, residual.get_device())
    entry = _ENTRIES.get(key)
    if entry is None:
        ok = supported(*((hidden_states,) if residual is None else (hidden_states, residual)), weight, casting=casting)
        loaded = extension() if ok else None
        if ok and loaded is None and status() == "building":
            return None  # ask again next call
        entry = loaded is not None and _prepare(loaded, residual is not None, hidden_states.shape,
                                                hidden_states.dtype, weight.dtype, casting == "gemma",
                                                offset != 0.0, hidden_states.get_device())
        if len(_ENTRIES) >= _ENTRIES_MAX:
            _ENTRIES.clear()
        _ENTRIES[key] = entry = entry or False
    if entry is False or _module is None or launch_hooks_registered():
        return None
    function, call = entry
    try:
        if residual is None:
            return function(hidden_states, weight, eps, offset, call)
        outputs = function(hidden_states, residual, weight, eps, offset, call)
        return None if outputs is None else (outputs[0], outputs[1])
    except RuntimeError as error:
        give_up(error)
        _ENTRIES.clear()
        return None


def _prepare(extension: ModuleType, residual: bool, shape: torch.Size, dtype: torch.dtype,
             weight_dtype: torch.dtype, gemma: bool, has_offset: bool, device: int) -> tuple | bool:
    """(extension function, ``NormCall``) for inputs of this signature, or False (not a GPU tensor, 2**31 rows or
    more, kernels whose launch the extension does not reproduce)."""
    n_cols = shape[-1]
    n_rows = shape.numel() // n_cols
    if n_rows >= 2**31 or n_rows == 0 or device < 0:
        return False
    plan_key = (residual, dtype, weight_dtype, n_cols, gemma, has_offset, device)
    if plan_key not in _NORM_PLANS:
        try:
            with torch.cuda.device(device):
                _NORM_PLANS[plan_key] = _build_norm_plan(extension, *plan_key)
        except Exception:  # noqa: BLE001 - an unexpected Triton API: the Python path always works
            logger.warning("kernels-triton: cannot prepare the C++ autograd path for %s; Python autograd instead",
                           plan_key, exc_info=True)
            _NORM_PLANS[plan_key] = None
    plan = _NORM_PLANS[plan_key]
    if plan is None:
        return False
    forward_rows = norm_tiling(n_cols, dtype.itemsize)[0]
    _, _, _, programs, rows_per_program, _ = norm_backward_tiling(n_rows, n_cols, dtype.itemsize, device)
    call = extension.NormCall(plan, forward_grid=cdiv(n_rows, forward_rows), programs=programs,
                              rows_per_program=rows_per_program)
    return (extension.residual_rms_norm if residual else extension.rms_norm), call


def norm_call(hidden_states: torch.Tensor, weight: torch.Tensor, *, residual: bool = False, casting: str = "llama",
              offset: float = 0.0) -> tuple[Callable[..., Any], object] | None:
    """The C++ node's entry for inputs of this signature, to time it alone: ``(function, call)``, or None while the
    extension is not loaded and where it does not take such inputs (CPU tensors, 2**31 rows or more).

    ``function(hidden_states, weight, eps, offset, call)`` (with ``residual=True``: ``function(hidden_states,
    residual, weight, eps, offset, call)``, returning the normalised sum and the sum) runs the node directly,
    without :func:`eager_norm`'s per-call lookup; its inputs must have the signature asked for here (shape, dtypes,
    device) and be contiguous and 16-byte aligned. This does not start the build (:func:`extension` does).

    Example:
        >>> norm_call(torch.zeros(4, 64), torch.ones(64)) is None   # CPU tensors: no C++ node
        True
    """
    if _module is None:
        return None
    return _prepare(_module, residual, hidden_states.shape, hidden_states.dtype, weight.dtype, casting == "gemma",
                    offset != 0.0, hidden_states.get_device()) or None


def _declined(*args: object, **kwargs: object) -> None:
    return None


class _PythonAutograd:
    """The context :func:`python_autograd` returns: swaps :func:`eager_norm` for a function that declines every
    call, so the hot path itself carries no switch. Nests; process-wide while it is entered."""

    def __init__(self) -> None:
        self._saved: list[Callable[..., Any]] = []

    def __enter__(self) -> None:
        self._saved.append(globals()["eager_norm"])
        globals()["eager_norm"] = _declined

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        globals()["eager_norm"] = self._saved.pop()


_PYTHON_AUTOGRAD = _PythonAutograd()


def python_autograd() -> _PythonAutograd:
    """A context within which the norms' eager calls with autograd take the Python ``autograd.Function`` path, as
    without the extension, to time the two paths side by side in one process.

    For benchmarks: it changes which path every thread's calls take while it is entered (the adapters look
    :func:`eager_norm` up on this module at each call), and costs a few hundred nanoseconds to enter and leave.

    Example (the node types need a GPU and, for the C++ one, the extension built, which the call outside the block
    would start; on CPU the native path runs):
        >>> from kernels_triton import ops
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x = torch.randn(4096, 1024, device=device, requires_grad=True)
        >>> w = torch.ones(1024, device=device)
        >>> with python_autograd():
        ...     y = ops.eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
        >>> type(y.grad_fn).__name__  # doctest: +SKIP
        '_RMSNormBackward'
        >>> y = ops.eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")  # doctest: +SKIP
        >>> type(y.grad_fn).__name__  # doctest: +SKIP
        'KernelsTritonRMSNormBackward'
    """
    return _PYTHON_AUTOGRAD


def _kernel(extension: ModuleType, kernel: object, args: tuple, num_warps: int) -> object | None:
    """``kernel`` compiled for ``args`` (dtypes stand for 16-byte aligned tensors) and loaded on the current
    device, as the extension's ``Kernel``; None if its launch is not one the extension reproduces."""
    compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps)  # type: ignore[attr-defined]
    letters = arg_types(compiled)
    if letters is None:
        return None
    compiled.run  # noqa: B018 - loads the binary on the current device and sets compiled.function
    metadata = compiled.metadata
    return extension.Kernel(function=compiled.function, threads=metadata.num_warps * metadata.target.warp_size,
                            shared_bytes=metadata.shared, arg_types=letters)


def _build_norm_plan(extension: ModuleType, residual: bool, dtype: torch.dtype, weight_dtype: torch.dtype,
                     n_cols: int, gemma: bool, has_offset: bool, device: int) -> object | None:
    """The compiled kernels of one norm variant as the extension's ``NormPlan``; None if one cannot be used.

    The arguments mirror the Python path's launches (``_norm_kernels``' launch functions), with row counts below
    2**31 (32-bit integers).
    """
    f32 = torch.float32
    block_m, block_n, num_warps = norm_tiling(n_cols, dtype.itemsize)
    # As the eager autograd path launches them: the forward stores no rstd (its RSTD slot gets the output), the
    # backward recomputes it (its RSTD slot gets dy).
    scalars = (2, 1e-6, 0.5, n_cols, gemma, has_offset, False, block_m, block_n)
    forward = ((_add_rms_norm_fwd_kernel, (dtype, dtype, weight_dtype, dtype, dtype, dtype)) if residual
               else (_rms_norm_fwd_kernel, (dtype, weight_dtype, dtype, dtype)))
    kernels = {"forward": _kernel(extension, forward[0], forward[1] + scalars, num_warps)}
    bwd_m, bwd_n, bwd_warps, _, _, stages = norm_backward_tiling(1, n_cols, dtype.itemsize, device)
    for name, has_ds in (("backward", False), ("backward_with_sum", True))[:1 + residual]:
        args = (dtype, dtype, dtype, weight_dtype, dtype, dtype, f32, 2, 1e-6, 0.5, 2, n_cols, gemma, has_offset,
                has_ds, True, bwd_m, bwd_n, stages)
        kernels[name] = _kernel(extension, _rms_norm_bwd_kernel, args, bwd_warps)
    sum_p, sum_c, sum_stages, sum_warps = SUM_TILING
    kernels["sum_partials"] = _kernel(extension, _sum_partials_kernel,
                                          (f32, weight_dtype, 2, n_cols, sum_p, sum_c, sum_stages), sum_warps)
    if any(kernel is None for kernel in kernels.values()):
        logger.info("kernels-triton: a norm kernel's launch is not one the C++ autograd extension reproduces; "
                    "Python autograd for %s", kernels)
        return None
    plan = extension.NormPlan()
    for name, kernel in kernels.items():
        setattr(plan, name, kernel)
    plan.sum_block_columns = sum_c
    return plan

