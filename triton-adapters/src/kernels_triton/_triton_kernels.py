"""Our own Triton kernels for the memory-bound layer kinds: RMSNorm (alone or fused with the residual add before
it), rotary embedding, gated activations.

Why not only Liger's: measured on an H200 (``benchmarks/results/cuda-rmsnorm-h200.json`` at commit 082ada2), Liger's RMSNorm spends
60-120 us per forward and ~600 us per backward on the host whatever the size, and neither it nor
``F.rms_norm`` reaches 85% of copy bandwidth between 16M and 67M elements. These kernels keep the Python side
to one launch per direction (the RMSNorm backward adds a second, small one that sums the weight gradient's
per-program rows; grid and block sizes cached per shape), compute in float32, and save for backward
only what the gradient needs (RMSNorm: the input, the backward recomputing each row's rstd; residual add +
RMSNorm: the sum, which is the next residual and kept anyway; gated activations: gate and up; RoPE: nothing but
the ``cos``/``sin`` it was given). The ``torch.compile`` custom ops (:mod:`kernels_triton._triton_ops`) save one
float32 rstd per row besides.

This module imports Triton at import time; adapters import it lazily, only for GPU tensors.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable
from types import ModuleType

import torch
import triton
import triton.language as tl

from . import _cpp_extension


__all__ = ["add_rms_norm_backward", "add_rms_norm_forward", "gated_activation", "gated_backward",
           "gated_forward", "residual_rms_norm", "rms_norm", "rms_norm_backward", "rms_norm_forward", "rotary",
           "rotary_launch", "sum_partial_rows", "unit_last_stride"]

# Rows longer than this do not fit one block's registers; callers take the native path instead.
MAX_RMS_NORM_COLS = 32768

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------- launching


class _Launcher:
    """Launch one ``@triton.jit`` kernel with less host work than ``kernel[grid](...)``.

    ``kernel[grid](...)`` binds and specialises every argument, builds a cache key from them and reads several
    settings on each call: tens of microseconds, which is the whole GPU time of a 16M-element RMSNorm. The
    kernels here declare every integer argument ``do_not_specialize``, so a compiled kernel depends only on the
    constexpr values, the tensor dtypes, the 16-byte alignment of each tensor and whether an integer needs 64
    bits. This class keys compiled kernels on exactly that (read cheaply), compiles through the normal launch on
    a miss, and otherwise launches the cached compiled kernel directly. Under Triton's interpreter, or if the
    direct launch ever fails, it uses the normal launch from then on.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, _Compiled] = {}
        params = getattr(kernel, "params", None)  # absent under the interpreter
        self.direct = params is not None and os.environ.get("KERNELS_TRITON_DIRECT_LAUNCH", "1") != "0"
        # Per parameter: how its argument enters the key. Constexprs and integers Triton may specialise on their
        # value are keyed by value; unspecialised integers only by whether they fit 32 bits.
        self.by_value = tuple(p.is_constexpr or not p.do_not_specialize for p in params or ())
        self._pickers: tuple[Callable[[tuple], tuple], ...] | None = None

    def _plan(self, args: tuple) -> tuple[Callable[[tuple], tuple], ...]:
        """Pickers of the tensor, value-keyed and unspecialised-integer arguments, from one call's arguments.

        Every call site passes the same kind of argument at each position, so where each kind sits is worked out
        once; floats are never specialised and stay out of the key.
        """
        tensors, values, integers = [], [], []
        for index, (by_value, arg) in enumerate(zip(self.by_value, args, strict=True)):
            if isinstance(arg, torch.Tensor):
                tensors.append(index)
            elif by_value or isinstance(arg, bool):
                values.append(index)
            elif isinstance(arg, int):
                integers.append(index)
        return tuple(_picker(positions) for positions in (tensors, values, integers))

    def _key(self, args: tuple) -> tuple:
        # Runs on every call: tensors by dtype and 16-byte alignment, value-keyed arguments by value,
        # unspecialised integers by whether they fit 32 bits.
        if self._pickers is None:
            self._pickers = self._plan(args)
        tensors, values, integers = self._pickers
        return (tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors(args)]), values(args),
                tuple([-(2**31) <= i < 2**31 for i in integers(args)]))

    def __call__(self, grid: int, *args: object, num_warps: int) -> None:
        if not self.direct:
            self.kernel[(grid,)](*args, num_warps=num_warps)
            return
        # Compiled kernels are loaded per device: the device (current, set by the adapters to the inputs') is
        # part of the key, like the per-device caches of Triton's own launch.
        device = args[0].get_device()
        key = (num_warps, device, self._key(args))
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.kernel[(grid,)](*args, num_warps=num_warps)
            try:
                self.compiled[key] = _Compiled(compiled)
            except AttributeError:  # a Triton without these attributes: its normal launch from now on
                logger.warning("kernels-triton: cannot launch %s directly with this Triton; using its normal "
                               "launch", self.kernel.__name__, exc_info=True)
                self.direct = False
            return
        try:
            entry.launch(grid, device, args)
        except Exception:  # noqa: BLE001 - an unexpected Triton API: the normal launch always works
            logger.warning("kernels-triton: direct launch of %s failed; using Triton's normal launch from now on",
                           self.kernel.__name__, exc_info=True)
            self.direct = False
            self.kernel[(grid,)](*args, num_warps=num_warps)


def _triton_runtime_knobs() -> object | None:
    """Triton's runtime settings, which hold the launch hooks (Triton 3.4+), or None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


_RUNTIME = _triton_runtime_knobs()


class _Compiled:
    """One compiled kernel and what its launch needs, read once.

    ``compiled[grid](*args)`` looks up the current device and stream through Triton's driver and builds launch
    metadata for the hooks on every call (H200: 8.7 us of host time per launch that way, 6.7 directly). With no
    launch hook registered this calls the compiled kernel's launcher directly with the tensor's device's current
    stream, the stream Triton itself would use; with hooks (a profiler) it takes Triton's own path so that they
    still run.
    """

    __slots__ = ("compiled", "function", "metadata", "run")

    def __init__(self, compiled: object) -> None:
        self.compiled = compiled
        self.run = compiled.run  # type: ignore[attr-defined]  # loads the binary and builds the launcher once
        self.function = compiled.function  # type: ignore[attr-defined]
        self.metadata = compiled.packed_metadata  # type: ignore[attr-defined]

    def launch(self, grid: int, device: int, args: tuple) -> None:
        if not launch_hooks_registered():
            self.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), self.function, self.metadata,
                     None, None, None, *args)
            return
        self.compiled[(grid, 1, 1)](*args)  # type: ignore[index]


def launch_hooks_registered() -> bool:
    """Whether a Triton launch hook (a profiler) is registered: launches must then take Triton's own path."""
    if _RUNTIME is None:
        return True  # a Triton without the runtime knobs: no way to tell, so assume hooks
    # Each hook is a chain of callables (Triton 3.5+), a callable or None: no hook when all are empty.
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook  # type: ignore[attr-defined]
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _picker(positions: list[int]) -> Callable[[tuple], tuple]:
    """A C-speed ``args -> tuple(args[i] for i in positions)``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        position = positions[0]
        return lambda args: (args[position],)
    return operator.itemgetter(*positions)


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: since Triton 3.5 that is a constexpr function, and called on the host it unwraps its
    # arguments and runs an import on every call (microseconds each, several per launch).
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` without its per-call overhead (see :func:`_cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# --------------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _normalize_rows(v, SRC, W, Y, RSTD, offs, rows, row_mask, cols, col_mask, mask, eps, offset,
                    N_COLS: tl.constexpr, GEMMA: tl.constexpr, HAS_OFFSET: tl.constexpr, STORE_RSTD: tl.constexpr):
    # RMSNorm of the float32 rows ``v`` (values of SRC's dtype), written to Y; shared by both forward kernels.
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / N_COLS + eps)
    vhat = v * rstd[:, None]
    w = tl.load(W + cols, mask=col_mask, other=0.0)
    if GEMMA:
        # Gemma: everything in float32, one rounding at the end.
        y = vhat * (w.to(tl.float32) + offset)[None, :]
    else:
        # Llama: round the normalised input to the input dtype, then scale by the weight (rounded after +offset).
        if HAS_OFFSET:
            w = (w.to(tl.float32) + offset).to(W.dtype.element_ty)
        y = vhat.to(SRC.dtype.element_ty).to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, n_rows, eps, offset, N_COLS: tl.constexpr,
    GEMMA: tl.constexpr, HAS_OFFSET: tl.constexpr, STORE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Rows are contiguous (row stride N_COLS): a constexpr width lets the compiler vectorise every load.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < N_COLS
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N_COLS + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    _normalize_rows(x, X, W, Y, RSTD, offs, rows, row_mask, cols, col_mask, mask, eps, offset, N_COLS, GEMMA,
                    HAS_OFFSET, STORE_RSTD)


@functools.lru_cache(maxsize=64)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _norm_tiling(n_cols: int, element_size: int, tile_bytes: int = 8192) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of about ``tile_bytes`` of input per program, whole rows per tile."""
    block_n = _next_power_of_2(n_cols)
    block_m = max(1, min(64, tile_bytes // (block_n * element_size)))
    elements = block_m * block_n
    num_warps = 4 if elements <= 4096 else 8 if elements <= 8192 else 16
    return block_m, block_n, num_warps


_launch_rms_norm_fwd = _Launcher(_rms_norm_fwd_kernel)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool,
                     store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward over a contiguous ``x`` of any rank, normalised over its last dimension: the output (same shape)
    and, if asked, one float32 rstd per row."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    rstd = x.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    block_m, block_n, num_warps = _norm_tiling(n_cols, x.element_size())
    _launch_rms_norm_fwd(
        _cdiv(n_rows, block_m), x, weight, y, rstd if rstd is not None else y, n_rows, eps, offset, n_cols,
        gemma, offset != 0.0, store_rstd, block_m, block_n, num_warps=num_warps,
    )
    return y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, gemma):
        # Saves the input only: the backward recomputes the rows' rstd (see _add_rms_norm_bwd_kernel).
        y, _ = rms_norm_forward(x, weight, eps, offset, gemma, store_rstd=False)
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, None, ctx.offset, ctx.gemma, want_dw=ctx.needs_input_grad[1],
                                   eps=ctx.eps)
        return dx, dw, None, None, None


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor | None,
                      offset: float, gemma: bool, *, want_dw: bool,
                      eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the input and (if ``want_dw``) of the weight, from the saved contiguous input and either its
    saved rstd or (``rstd=None``) the forward's ``eps``, to recompute it.

    The fused residual kernel's backward with no gradient reaching the sum directly is exactly this.
    """
    return add_rms_norm_backward(dy, None, x, weight, rstd, offset, gemma, want_dw=want_dw, eps=eps)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
             gemma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension; output in the input dtype. Callers check the supported cases.

    Without autograd (inference, ``no_grad``) the kernel runs directly. A contiguous input is read in place
    and the output has its shape: no reshapes on the way (each costs host time per call).
    """
    x = hidden_states.contiguous()  # the tensor itself when it already is
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        y = _cpp_norm(x, None, weight, float(eps), float(offset), gemma)
        return y if y is not None else _RMSNorm.apply(x, weight, float(eps), float(offset), gemma)
    return rms_norm_forward(x, weight, float(eps), float(offset), gemma, store_rstd=False)[0]


# ------------------------------------------------------------------------------------- residual add + RMSNorm


@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD, n_rows, eps, offset, N_COLS: tl.constexpr,
    GEMMA: tl.constexpr, HAS_OFFSET: tl.constexpr, STORE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The RMSNorm forward above, reading the attention output and the residual instead of one input and writing
    # their sum (the next residual) beside the normalised rows.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < N_COLS
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N_COLS + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    # Eager adds in the input dtype and normalises that rounded sum: round here at the same point.
    s = (x + r).to(S.dtype.element_ty)
    tl.store(S + offs, s, mask=mask)
    _normalize_rows(s.to(tl.float32), S, W, Y, RSTD, offs, rows, row_mask, cols, col_mask, mask, eps, offset, N_COLS,
                    GEMMA, HAS_OFFSET, STORE_RSTD)


@triton.jit
def _add_pairs(a_sum, b_sum, a, b):
    return a_sum + a, b_sum + b


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _add_rms_norm_bwd_kernel(
    DY, DS, S, W, RSTD, DX, DW_PARTIAL, n_rows, eps, offset, rows_per_program, N_COLS: tl.constexpr,
    GEMMA: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_DS: tl.constexpr, RECOMPUTE_RSTD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    # The RMSNorm backward over the saved sum, plus the gradient reaching the sum directly (the layer's final
    # residual add): dx = d_norm(dy) + ds, which is also the residual's gradient. One rounding, in float32.
    # RECOMPUTE_RSTD: the rows' rstd from the saved input (a row sum over registers already loaded) instead of a
    # saved float32 per row, so the forward allocates and saves nothing but its output.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N_COLS
    w = tl.load(W + cols, mask=col_mask, other=0.0)
    if GEMMA:
        scale = w.to(tl.float32) + offset
    elif HAS_OFFSET:
        scale = (w.to(tl.float32) + offset).to(W.dtype.element_ty).to(tl.float32)
    else:
        scale = w.to(tl.float32)
    # The weight gradient accumulates per row and is summed over rows once at the end: a sum over the tile's
    # rows at every step would cross warps (shared memory and a barrier per tile), which narrow rows (many per
    # tile) pay most.
    dw_rows = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # STAGES > 1 lets the compiler prefetch the next rows' loads while this tile computes (each program walks
    # many tiles, so without it every tile waits for its own loads).
    for start in tl.range(first, last, BLOCK_M, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < last
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N_COLS + cols[None, :]
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * scale[None, :]
        if RECOMPUTE_RSTD:
            # Both row sums in one reduction, neither waiting for the other: the sum of squares gives the rstd
            # as the forward computes it, sum(g * s) the projection term once the rstd is known. Rows past the
            # end get an rstd of 0, not rsqrt(eps) (infinite when eps is 0).
            sum_sq, sum_gs = tl.reduce((s * s, g * s), 1, _add_pairs)
            rstd = tl.where(row_mask, tl.rsqrt(sum_sq / N_COLS + eps), 0.0)
        else:
            sum_gs = tl.sum(g * s, axis=1)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        shat = s * rstd[:, None]
        if GEMMA:
            dw_rows += dy * shat
        else:
            dw_rows += dy * shat.to(S.dtype.element_ty).to(tl.float32)
        c = rstd * sum_gs / N_COLS  # the mean of g * shat
        dx = (g - shat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * N_COLS + cols, tl.sum(dw_rows, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["n_partials"])
def _sum_partials_kernel(PARTIAL, OUT, n_partials, N_COLS: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    # Column sums of the backward's per-program float32 weight-gradient rows, in a fixed order (deterministic),
    # rounded once to the weight's dtype: one launch where ``partial.sum(0).to(dtype)`` is two ops.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N_COLS
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    # Latency-bound (a few hundred rows, a few loads per program): STAGES > 1 issues the next loads early.
    for start in tl.range(0, n_partials, BLOCK_P, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + rows.to(tl.int64)[:, None] * N_COLS + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


# The backward's launch shape, from the H200 sweeps (GPU time with the weight-gradient sum, us): 2 programs per
# SM, 8 KiB tiles, 3 pipeline stages is within 4% of each shape's best from 8M to 67M elements
# (benchmarks/results/cuda-rmsnorm-tiling-h200.json at commit eb4812f: 16384x1024 34.4 vs 43.6 without pipelining, 8192x8192 111
# vs 145). Since the weight gradient accumulates per row (rmsnorm-tiling-h200.json) that
# holds for rows of 128 too (131072x128: 34.7, best 33.7; 4 programs per SM, the earlier choice there: 39.4).
BACKWARD_PROGRAMS_PER_SM = 2
BACKWARD_TILE_BYTES = 8192
BACKWARD_STAGES = 3
# The weight-gradient sum's launch shape: (BLOCK_P rows, BLOCK_C columns, pipeline stages, warps). The sum is
# latency-bound (a few hundred partial rows): 128-row steps, 16 columns per program and pipelined loads take
# 2.6-3.9 us where 32 x 32 unpipelined took 5.0-7.5 (same sweep, 8M-16M elements, rows of 128-4096).
SUM_TILING = (128, 16, 3, 4)


@functools.lru_cache(maxsize=1024)
def _norm_backward_tiling(n_rows: int, n_cols: int, element_size: int, device_index: int, *,
                          programs_per_sm: int = 0, tile_bytes: int = 0, stages: int = 0) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, programs, rows per program, stages) of the backward; zero: the default.

    A few programs per SM, each reducing its rows' weight gradient in registers: one float32 row per program to
    sum afterwards instead of atomics (deterministic).
    """
    block_m, block_n, num_warps = _norm_tiling(n_cols, element_size, tile_bytes or BACKWARD_TILE_BYTES)
    per_sm = programs_per_sm or BACKWARD_PROGRAMS_PER_SM
    programs = max(1, min(per_sm * _sm_count(device_index), _cdiv(n_rows, block_m)))
    rows_per_program = _cdiv(_cdiv(n_rows, programs), block_m) * block_m
    return (block_m, block_n, num_warps, _cdiv(n_rows, rows_per_program), rows_per_program,
            stages or BACKWARD_STAGES)


_launch_add_rms_norm_fwd = _Launcher(_add_rms_norm_fwd_kernel)
_launch_add_rms_norm_bwd = _Launcher(_add_rms_norm_bwd_kernel)
_launch_sum_partials = _Launcher(_sum_partials_kernel)


def add_rms_norm_forward(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                         gemma: bool, store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Over contiguous same-shape ``x`` and ``r`` of any rank: the normalised sum, the sum, and (if asked) the rstd."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    s = torch.empty_like(x)
    rstd = x.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    block_m, block_n, num_warps = _norm_tiling(n_cols, x.element_size())
    _launch_add_rms_norm_fwd(
        _cdiv(n_rows, block_m), x, r, weight, y, s, rstd if rstd is not None else y, n_rows, eps, offset,
        n_cols, gemma, offset != 0.0, store_rstd, block_m, block_n, num_warps=num_warps,
    )
    return y, s, rstd


def add_rms_norm_backward(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor | None, offset: float, gemma: bool, *, want_dw: bool,
                          eps: float | None = None,
                          tiling: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of the sum's inputs (the same for the attention output and the residual) and of the weight.

    ``s`` is the saved contiguous sum (any rank), ``dy`` the gradient of the normalised output, ``ds`` that of
    the sum itself (None: zero); the input gradient has ``s``'s shape. The rows' rstd is either the forward's
    saved ``rstd`` or, with ``rstd=None``, recomputed from ``s`` with the forward's ``eps``. ``tiling``
    overrides the launch shape (:func:`_norm_backward_tiling`; benchmarks sweep it).
    """
    if (rstd is None) == (eps is None):
        raise ValueError("add_rms_norm_backward takes either the saved rstd or the eps to recompute it, not "
                         f"{'both' if rstd is not None else 'neither'}")
    n_cols = s.shape[-1]
    n_rows = s.numel() // n_cols
    dy = dy.contiguous()
    ds = ds.contiguous() if ds is not None else None
    dx = torch.empty_like(s)
    block_m, block_n, num_warps, programs, rows_per_program, stages = tiling or _norm_backward_tiling(
        n_rows, n_cols, s.element_size(), s.get_device())
    partial = s.new_empty((programs, n_cols), dtype=torch.float32)
    _launch_add_rms_norm_bwd(
        programs, dy, ds if ds is not None else dy, s, weight, rstd if rstd is not None else dy, dx, partial, n_rows,
        0.0 if eps is None else eps, offset, rows_per_program, n_cols, gemma, offset != 0.0, ds is not None,
        rstd is None, block_m, block_n, stages, num_warps=num_warps,
    )
    if not want_dw:
        return dx, None
    dw = weight.new_empty(weight.shape)  # contiguous, whatever the weight's strides
    sum_partial_rows(partial, dw)
    return dx, dw


def sum_partial_rows(partial: torch.Tensor, out: torch.Tensor, *,
                     tiling: tuple[int, int, int, int] | None = None) -> None:
    """``out[:] = partial.sum(0)`` in ``out``'s dtype, one launch: the backward's per-program weight-gradient rows.

    ``partial`` is a contiguous float32 ``[programs, n_cols]``, ``out`` a contiguous ``[n_cols]``; ``tiling``
    overrides :data:`SUM_TILING` (benchmarks sweep it).
    """
    programs, n_cols = partial.shape
    block_p, block_c, stages, num_warps = tiling or SUM_TILING
    _launch_sum_partials(_cdiv(n_cols, block_c), partial, out, programs, n_cols, block_p, block_c, stages,
                         num_warps=num_warps)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, weight, eps, offset, gemma):
        y, s, _ = add_rms_norm_forward(x, r, weight, eps, offset, gemma, store_rstd=False)
        # The sum is an output the caller keeps anyway (it is the next residual): saving it costs no memory. The
        # backward recomputes the rows' rstd from it.
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        if dy is None:  # the normalised output was not used: only the sum's gradient flows, unchanged
            return ds if need_x else None, ds if need_r else None, None, None, None, None
        dx, dw = add_rms_norm_backward(dy, ds, s, weight, None, ctx.offset, ctx.gemma, want_dw=need_w, eps=ctx.eps)
        return dx if need_x else None, dx if need_r else None, dw, None, None, None


def residual_rms_norm(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                      offset: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + hidden_states), residual + hidden_states)`` in one launch per direction.

    Same-shape, same-dtype inputs; outputs in that dtype. Callers check the supported cases. Saves the sum (which
    the caller keeps as the next residual anyway); under ``no_grad`` nothing.
    """
    x, r = hidden_states.contiguous(), residual.contiguous()
    if torch.is_grad_enabled() and (hidden_states.requires_grad or residual.requires_grad or weight.requires_grad):
        outputs = _cpp_norm(x, r, weight, float(eps), float(offset), gemma)
        return outputs if outputs is not None else _AddRMSNorm.apply(x, r, weight, float(eps), float(offset), gemma)
    y, s, _ = add_rms_norm_forward(x, r, weight, float(eps), float(offset), gemma, store_rstd=False)
    return y, s


# ------------------------------------------------------------------------ C++ autograd nodes for the norms
# With autograd, the two norms above run as C++ autograd functions (``_autograd_ext.cpp``) once the extension is
# built (:mod:`kernels_triton._cpp_extension`): the same compiled kernels and launch shapes, minus the Python
# autograd node whose backward costs more host time than a mid-size layer's GPU time.

_NORM_PLANS: dict[tuple, object | None] = {}


def _cpp_kernel(extension: ModuleType, kernel: triton.runtime.JITFunction, args: tuple,
                num_warps: int) -> object | None:
    """``kernel`` compiled for ``args`` (dtypes stand for 16-byte aligned tensors) and loaded on the current
    device, as the extension's ``Kernel``; None if its launch is not one the extension reproduces."""
    compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps)
    letters = _cpp_extension.arg_types(compiled)
    if letters is None:
        return None
    compiled.run  # noqa: B018 - loads the binary on the current device and sets compiled.function
    metadata = compiled.metadata
    return extension.Kernel(function=compiled.function, threads=metadata.num_warps * metadata.target.warp_size,
                            shared_bytes=metadata.shared, arg_types=letters)


def _build_norm_plan(extension: ModuleType, residual: bool, dtype: torch.dtype, weight_dtype: torch.dtype,
                     n_cols: int, gemma: bool, has_offset: bool, device: int) -> object | None:
    """The compiled kernels of one norm variant as the extension's ``NormPlan``; None if one cannot be used.

    The arguments mirror the Python path's launches (:func:`rms_norm_forward`, :func:`add_rms_norm_forward`,
    :func:`add_rms_norm_backward`, :func:`sum_partial_rows`), with row counts below 2**31 (32-bit integers).
    """
    f32 = torch.float32
    element_size = dtype.itemsize
    block_m, block_n, num_warps = _norm_tiling(n_cols, element_size)
    if residual:
        forward = (_add_rms_norm_fwd_kernel, (dtype, dtype, weight_dtype, dtype, dtype, dtype))
    else:
        forward = (_rms_norm_fwd_kernel, (dtype, weight_dtype, dtype, dtype))
    # As the eager autograd path launches them: the forward stores no rstd (its RSTD slot gets the output), the
    # backward recomputes it (its RSTD slot gets dy).
    scalars = (2, 1e-6, 0.5, n_cols, gemma, has_offset, False, block_m, block_n)
    kernels = {"forward": _cpp_kernel(extension, forward[0], forward[1] + scalars, num_warps)}
    bwd_m, bwd_n, bwd_warps, _, _, stages = _norm_backward_tiling(1, n_cols, element_size, device)
    for name, has_ds in (("backward", False), ("backward_with_sum", True)):
        if has_ds and not residual:
            continue
        args = (dtype, dtype, dtype, weight_dtype, dtype, dtype, f32, 2, 1e-6, 0.5, 2, n_cols, gemma, has_offset,
                has_ds, True, bwd_m, bwd_n, stages)
        kernels[name] = _cpp_kernel(extension, _add_rms_norm_bwd_kernel, args, bwd_warps)
    sum_p, sum_c, sum_stages, sum_warps = SUM_TILING
    kernels["sum_partials"] = _cpp_kernel(extension, _sum_partials_kernel,
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


# Per input signature: (extension function, NormCall), or False where the C++ path cannot be used. Bounded: row
# counts vary with batch and sequence length.
_CPP_CALLS: dict[tuple, tuple | bool] = {}
_CPP_CALLS_MAX = 4096


def cpp_path_usable() -> bool:
    """Whether norms may go through the C++ autograd extension now: it is loaded (not building, failed or given
    up) and no Triton launch hook is registered (a profiler sees every launch on the Python path). Runs on every
    call; the extension itself declines (returns None for) inputs its kernels do not take as they are
    (non-contiguous, not 16-byte aligned, a weight of another width or device).
    """
    return _cpp_extension.extension() is not None and not launch_hooks_registered()


def cpp_norm_entry(residual: bool, shape: torch.Size, dtype: torch.dtype, weight_dtype: torch.dtype, gemma: bool,
                   has_offset: bool, device: int) -> tuple | None:
    """(extension function, ``NormCall``) for the norm on inputs of this signature on CUDA device ``device``, or
    None where the C++ path does not take them (no extension loaded yet, 2**31 rows or more, kernels whose launch
    the extension does not reproduce). Looked up once per signature and cached; :func:`cpp_path_usable` says per
    call whether the entry may be used."""
    extension = _cpp_extension.extension()
    if extension is None or device < 0:
        return None
    key = (residual, shape, dtype, weight_dtype, gemma, has_offset, device)
    entry = _CPP_CALLS.get(key)
    if entry is None:
        if len(_CPP_CALLS) >= _CPP_CALLS_MAX:
            _CPP_CALLS.clear()
        entry = _CPP_CALLS[key] = _prepare_cpp_call(extension, *key)
    return entry or None


def _cpp_norm_call(residual: bool, x: torch.Tensor, weight: torch.Tensor, offset: float, gemma: bool) -> tuple | None:
    """:func:`cpp_norm_entry` for a call on ``x`` if :func:`cpp_path_usable`, else None: the Python autograd path
    then runs. CPU tensors never take it."""
    if not x.is_cuda or not cpp_path_usable():
        return None
    return cpp_norm_entry(residual, x.shape, x.dtype, weight.dtype, gemma, offset != 0.0, x.get_device())


def run_cpp_norm(entry: tuple, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The norm through the extension with an entry of :func:`cpp_norm_entry`, or None, and the caller takes the
    Python autograd path: when the extension declines the inputs (see :func:`cpp_path_usable`) or the call fails
    there, which gives the extension up for the rest of the process
    (:func:`kernels_triton._cpp_extension.give_up`)."""
    function, call = entry
    try:
        if residual is None:
            return function(x, weight, eps, offset, call)
        outputs = function(x, residual, weight, eps, offset, call)
        return None if outputs is None else (outputs[0], outputs[1])
    except RuntimeError as error:
        _cpp_extension.give_up(error)
        _CPP_CALLS.clear()
        return None


def _cpp_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float,
              gemma: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The RMSNorm of ``x`` (with ``residual``: of ``x + residual``, and that sum) through the C++ autograd
    extension, or None: the caller then takes the Python autograd path."""
    entry = _cpp_norm_call(residual is not None, x, weight, offset, gemma)
    return None if entry is None else run_cpp_norm(entry, x, residual, weight, eps, offset)


def _prepare_cpp_call(extension: ModuleType, residual: bool, shape: torch.Size, dtype: torch.dtype,
                      weight_dtype: torch.dtype, gemma: bool, has_offset: bool, device: int) -> tuple | bool:
    n_cols = shape[-1]
    n_rows = shape.numel() // n_cols
    if n_rows >= 2**31 or n_rows == 0:
        return False
    plan_key = (residual, dtype, weight_dtype, n_cols, gemma, has_offset, device)
    try:
        plan = _NORM_PLANS[plan_key]
    except KeyError:
        try:
            with torch.cuda.device(device):
                plan = _build_norm_plan(extension, residual, dtype, weight_dtype, n_cols, gemma, has_offset, device)
        except Exception:  # noqa: BLE001 - an unexpected Triton API: the Python path always works
            logger.warning("kernels-triton: cannot prepare the C++ autograd path for %s; Python autograd instead",
                           plan_key, exc_info=True)
            plan = None
        _NORM_PLANS[plan_key] = plan
    if plan is None:
        return False
    element_size = dtype.itemsize
    forward_rows = _norm_tiling(n_cols, element_size)[0]
    _, _, _, programs, rows_per_program, _ = _norm_backward_tiling(n_rows, n_cols, element_size, device)
    call = extension.NormCall(plan, forward_grid=_cdiv(n_rows, forward_rows), programs=programs,
                              rows_per_program=rows_per_program)
    return (extension.residual_rms_norm if residual else extension.rms_norm), call


# --------------------------------------------------------------------------------------------------- RoPE


@triton.jit
def _rotate_heads(SRC, DST, b, s, n_heads, head_dim, s_b, s_h, s_s, o_b, o_h, o_s, a11, a12, a21, a22,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    h_mask = h < n_heads
    mask = h_mask[:, None] & (d < HALF)[None, :]
    src = SRC + b * s_b + s * s_s + h[:, None].to(tl.int64) * s_h
    dst = DST + b * o_b + s * o_s + h[:, None].to(tl.int64) * o_h
    x1 = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * a11[None, :] + x2 * a12[None, :]
    y2 = x1 * a21[None, :] + x2 * a22[None, :]
    tl.store(dst + d[None, :], y1.to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d[None, :], y2.to(DST.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        # Partial rotation: the dims past the rotated ones pass through unchanged.
        p = tl.arange(0, BLOCK_PASS)
        pass_mask = h_mask[:, None] & (p < head_dim - 2 * HALF)[None, :]
        rest = tl.load(src + 2 * HALF + p[None, :], mask=pass_mask, other=0.0)
        tl.store(dst + 2 * HALF + p[None, :], rest, mask=pass_mask)


@triton.jit(do_not_specialize=["n_seq", "n_q_heads", "n_k_heads", "head_dim", "sq_b", "sq_h", "sq_s", "sk_b",
                               "sk_h", "sk_s", "sqo_b", "sqo_h", "sqo_s", "sko_b", "sko_h", "sko_s", "sc_b", "sc_s"])
def _rotary_kernel(
    Q, K, COS, SIN, QO, KO, n_seq, n_q_heads, n_k_heads, head_dim,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s, sc_b, sc_s,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr, ALIGNED: tl.constexpr,
):
    # One program per (batch, position): all heads of q and k share that position's cos/sin.
    if ALIGNED:
        # Every stride is a multiple of 16 elements (checked at launch): lets the compiler vectorise along d.
        sq_b, sq_h, sq_s = tl.multiple_of(sq_b, 16), tl.multiple_of(sq_h, 16), tl.multiple_of(sq_s, 16)
        sk_b, sk_h, sk_s = tl.multiple_of(sk_b, 16), tl.multiple_of(sk_h, 16), tl.multiple_of(sk_s, 16)
        sqo_b, sqo_h, sqo_s = tl.multiple_of(sqo_b, 16), tl.multiple_of(sqo_h, 16), tl.multiple_of(sqo_s, 16)
        sko_b, sko_h, sko_s = tl.multiple_of(sko_b, 16), tl.multiple_of(sko_h, 16), tl.multiple_of(sko_s, 16)
        sc_b, sc_s = tl.multiple_of(sc_b, 16), tl.multiple_of(sc_s, 16)
    pid = tl.program_id(0)
    b = (pid // n_seq).to(tl.int64)
    s = (pid % n_seq).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    trig = b * sc_b + s * sc_s
    c1 = tl.load(COS + trig + d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + trig + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + trig + d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + trig + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    # Forward: [y1, y2] = [[c1, -s1], [s2, c2]] @ [x1, x2]; backward applies the transpose to the gradient.
    if BACKWARD:
        a11, a12, a21, a22 = c1, s2, -s1, c2
    else:
        a11, a12, a21, a22 = c1, -s1, s2, c2
    _rotate_heads(Q, QO, b, s, n_q_heads, head_dim, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s, a11, a12, a21, a22,
                  HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K, KO, b, s, n_k_heads, head_dim, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s, a11, a12, a21, a22,
                  HALF, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


_launch_rotary = _Launcher(_rotary_kernel)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its last dimension is dense (what the RoPE kernel needs), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=256)
def _rotary_config(n_q_heads: int, n_k_heads: int, half: int, passthrough: int) -> tuple[int, int, int, int, int]:
    """(Q_HEADS, K_HEADS, HALF, PASSTHROUGH blocks, num_warps) of the RoPE launch for one head layout."""
    heads = max(n_q_heads, n_k_heads) * _next_power_of_2(half)
    return (_next_power_of_2(n_q_heads), _next_power_of_2(n_k_heads), _next_power_of_2(half),
            _next_power_of_2(passthrough), 4 if heads <= 2048 else 8)


def rotary_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch rotating q and k (``backward``: by the inverse rotation, which is the gradient); new outputs."""
    batch, n_q_heads, n_seq, head_dim = q.shape
    n_k_heads = k.shape[1]
    half = cos.shape[-1] // 2
    q_out = torch.empty_like(q)  # same strides as q, as eager's elementwise math gives
    k_out = torch.empty_like(k)
    q_block, k_block, half_block, passthrough_block, num_warps = _rotary_config(
        n_q_heads, n_k_heads, half, head_dim - 2 * half)
    cos_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    strides = (*q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3], cos_batch_stride,
               cos.stride(1))
    _launch_rotary(
        batch * n_seq, q, k, cos, sin, q_out, k_out, n_seq, n_q_heads, n_k_heads, head_dim, *strides,
        half, q_block, k_block, half_block, passthrough_block, backward,
        half % 8 == 0 and all(stride % 16 == 0 for stride in strides), num_warps=num_warps,
    )
    return q_out, k_out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotary_launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rotary_launch(unit_last_stride(dq), unit_last_stride(dk), cos, sin, backward=True)
        return dq_in, dk_in, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """Rotate-half RoPE over the first ``cos.shape[-1]`` dims of q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]``.

    ``cos``/``sin`` are ``[B or 1, S, R]`` with a unit last stride; q and k need a unit last stride. New tensors
    are returned (the inputs are never modified) with the strides of q and k.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin)
    return rotary_launch(q, k, cos, sin, backward=False)


# --------------------------------------------------------------------------------------------- gated MLPs


@triton.jit
def _tanh(x):
    # tanh through exp2, stable for large |x| (exp2 of a non-positive argument never overflows).
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _load_pair(A, B, offs, n, EVEN: tl.constexpr):
    # EVEN: the length is a multiple of the block (checked at launch), so no mask: with an unspecialised length a
    # mask would keep the compiler from vectorising (measured on the H200: half the bandwidth).
    if EVEN:
        return tl.load(A + offs).to(tl.float32), tl.load(B + offs).to(tl.float32)
    mask = offs < n
    return (tl.load(A + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(B + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store(PTR, offs, value, n, EVEN: tl.constexpr):
    if EVEN:
        tl.store(PTR + offs, value.to(PTR.dtype.element_ty))
    else:
        tl.store(PTR + offs, value.to(PTR.dtype.element_ty), mask=offs < n)


@triton.jit(do_not_specialize=["n"])
def _gated_fwd_kernel(GATE, UP, OUT, n, GELU: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a, b = _load_pair(GATE, UP, offs, n, EVEN)
    if GELU:
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        act = 0.5 * a * (1.0 + _tanh(inner))
    else:
        act = a * tl.sigmoid(a)
    _store(OUT, offs, act * b, n, EVEN)


@triton.jit(do_not_specialize=["n"])
def _gated_bwd_kernel(DOUT, GATE, UP, DGATE, DUP, n, GELU: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(DOUT + offs).to(tl.float32)
    else:
        g = tl.load(DOUT + offs, mask=offs < n, other=0.0).to(tl.float32)
    a, b = _load_pair(GATE, UP, offs, n, EVEN)
    if GELU:
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        t = _tanh(inner)
        act = 0.5 * a * (1.0 + t)
        d_act = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * a * a)
    else:
        sig = tl.sigmoid(a)
        act = a * sig
        d_act = sig * (1.0 + a * (1.0 - sig))
    _store(DGATE, offs, g * b * d_act, n, EVEN)
    _store(DUP, offs, g * act, n, EVEN)


# 1024 divides every common intermediate size times any token count (3072, 4096, 8192, 11008, 14336, ...).
_GATED_BLOCK = 1024
_launch_gated_fwd = _Launcher(_gated_fwd_kernel)
_launch_gated_bwd = _Launcher(_gated_bwd_kernel)


def gated_forward(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` into a new tensor, for contiguous same-shape, same-dtype operands."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _launch_gated_fwd(_cdiv(n, _GATED_BLOCK), gate, up, out, n, gelu, _GATED_BLOCK, n % _GATED_BLOCK == 0,
                      num_warps=4)
    return out


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gelu):
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        # Only intermediate results of the graph (not a caller's leaf tensors, not views into other tensors) may
        # have their storage reused for the gradients in backward.
        ctx.reuse = all(t.grad_fn is not None and t._base is None for t in (gate, up))
        return gated_forward(gate, up, gelu)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        # The gradients overwrite the saved gate and up (each element is read before it is written), as Liger
        # does: two fewer [tokens, intermediate] tensors while the backward of the MLP runs. Bumping their version
        # makes any other autograd node that saved the same tensors raise instead of reading gradients.
        dgate, dup = gated_backward(dout, gate, up, ctx.gelu, into_inputs=ctx.reuse)
        if ctx.reuse:
            torch.autograd.graph.increment_version((gate, up))
        return dgate, dup, None


def gated_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool, *,
                   into_inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of gate and up; ``into_inputs`` writes them over gate and up themselves."""
    dout = dout.contiguous()
    n = gate.numel()
    dgate, dup = (gate, up) if into_inputs else (torch.empty_like(gate), torch.empty_like(up))
    _launch_gated_bwd(_cdiv(n, _GATED_BLOCK), dout, gate, up, dgate, dup, n, gelu, _GATED_BLOCK,
                      n % _GATED_BLOCK == 0, num_warps=4)
    return dgate, dup


def gated_activation(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for contiguous same-shape, same-dtype tensors; saves only gate and up for backward."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _Gated.apply(gate, up, gelu)
    return gated_forward(gate, up, gelu)
