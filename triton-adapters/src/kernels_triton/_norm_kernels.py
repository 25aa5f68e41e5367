"""The RMSNorm family's Triton kernels, their launch shapes and the host functions that launch them.

The RMSNorm forward, the residual add + RMSNorm forward, the backward both share (the residual's adds the gradient
reaching the sum directly) and the sum of the backward's per-program weight-gradient rows. Two autograd paths launch
these same compiled kernels with the same launch shapes: the Python ``autograd.Function`` of
:mod:`kernels_triton._rms_norm` and :mod:`kernels_triton._residual_rms_norm`, and the C++ nodes of
:mod:`kernels_triton._cpp_extension`. Keeping the kernels here, apart from both, is what lets the adapters call the
C++ path without the C++ path importing the adapters back.

Importing this module imports Triton. The launch functions run on GPU tensors, or on CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported), as the examples below do on a machine without a
GPU.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from ._launch import next_power_of_2
from ._launch import sm_count


__all__ = ["BACKWARD_PROGRAMS_PER_SM", "BACKWARD_STAGES", "BACKWARD_TILE_BYTES", "SUM_TILING",
           "add_rms_norm_backward", "add_rms_norm_forward", "norm_backward_tiling", "norm_tiling",
           "rms_norm_backward", "rms_norm_forward", "sum_partial_rows"]

# ------------------------------------------------------------------------------------------------------ kernels


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
def _rms_norm_bwd_kernel(
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
# (the tiling sweep at commit eb4812f: 16384x1024 34.4 vs 43.6 without
# pipelining, 8192x8192 111 vs 145). Since the weight gradient accumulates per row (rmsnorm-tiling-h200.json) that
# holds for rows of 128 too (131072x128: 34.7, best 33.7; 4 programs per SM, the earlier choice there: 39.4).
BACKWARD_PROGRAMS_PER_SM = 2
BACKWARD_TILE_BYTES = 8192
BACKWARD_STAGES = 3
# The weight-gradient sum's launch shape: (BLOCK_P rows, BLOCK_C columns, pipeline stages, warps). The sum is
# latency-bound (a few hundred partial rows): 128-row steps, 16 columns per program and pipelined loads take
# 2.6-3.9 us where 32 x 32 unpipelined took 5.0-7.5 (same sweep, 8M-16M elements, rows of 128-4096).
SUM_TILING = (128, 16, 3, 4)


@functools.lru_cache(maxsize=1024)
def norm_backward_tiling(n_rows: int, n_cols: int, element_size: int, device_index: int, *,
                          programs_per_sm: int = 0, tile_bytes: int = 0, stages: int = 0) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, programs, rows per program, stages) of the backward; zero: the default.

    A few programs per SM, each reducing its rows' weight gradient in registers: one float32 row per program to
    sum afterwards instead of atomics (deterministic). ``device_index`` is the CUDA device whose SM count sets the
    program count.

    Example (on a GPU: the program count depends on its SM count):
        >>> block_m, block_n, num_warps, programs, rows_per_program, stages = norm_backward_tiling(
        ...     8192, 1024, 2, 0)  # doctest: +SKIP
        >>> (block_m, block_n, stages), programs * rows_per_program >= 8192  # doctest: +SKIP
        ((4, 1024, 3), True)
    """
    block_m, block_n, num_warps = norm_tiling(n_cols, element_size, tile_bytes or BACKWARD_TILE_BYTES)
    per_sm = programs_per_sm or BACKWARD_PROGRAMS_PER_SM
    programs = max(1, min(per_sm * sm_count(device_index), cdiv(n_rows, block_m)))
    rows_per_program = cdiv(cdiv(n_rows, programs), block_m) * block_m
    return (block_m, block_n, num_warps, cdiv(n_rows, rows_per_program), rows_per_program,
            stages or BACKWARD_STAGES)


@functools.lru_cache(maxsize=1024)
def norm_tiling(n_cols: int, element_size: int, tile_bytes: int = 8192) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles of about ``tile_bytes`` of input per program, whole rows per tile.

    Example:
        >>> norm_tiling(1024, 2)   # bf16 rows of 1024: four rows per 8 KiB tile
        (4, 1024, 4)
    """
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(64, tile_bytes // (block_n * element_size)))
    elements = block_m * block_n
    num_warps = 4 if elements <= 4096 else 8 if elements <= 8192 else 16
    return block_m, block_n, num_warps


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool,
                     store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward over a contiguous ``x`` of any rank, normalised over its last dimension: the output (same shape)
    and, if asked, one float32 rstd per row. ``gemma`` selects Gemma's casting (everything in float32, one
    rounding) over Llama's; ``offset`` is added to the weight.

    Example (on CPU tensors, in Triton's interpreter):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x, w = torch.randn(4, 64, device=device), torch.ones(64, device=device)
        >>> y, rstd = rms_norm_forward(x, w, 1e-6, 0.0, False, store_rstd=True)
        >>> torch.allclose(y, x * rstd[:, None], atol=1e-5), rstd.shape
        (True, torch.Size([4]))
    """
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    rstd = x.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    block_m, block_n, num_warps = norm_tiling(n_cols, x.element_size())
    _rms_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
        x, weight, y, rstd if rstd is not None else y, n_rows, eps, offset, n_cols,
        gemma, offset != 0.0, store_rstd, block_m, block_n, num_warps=num_warps,
    )
    return y, rstd


def add_rms_norm_forward(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                         gemma: bool, store_rstd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Over contiguous same-shape ``x`` and ``r`` of any rank: the normalised sum, the sum, and (if asked) the rstd.

    Example (on CPU tensors, in Triton's interpreter):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x, r = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
        >>> w = torch.ones(64, device=device)
        >>> y, s, _ = add_rms_norm_forward(x, r, w, 1e-6, 0.0, False, store_rstd=False)
        >>> torch.equal(s, x + r), torch.allclose(y, rms_norm_forward(s, w, 1e-6, 0.0, False, store_rstd=False)[0])
        (True, True)
    """
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    s = torch.empty_like(x)
    rstd = x.new_empty((n_rows,), dtype=torch.float32) if store_rstd else None
    block_m, block_n, num_warps = norm_tiling(n_cols, x.element_size())
    _add_rms_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
        x, r, weight, y, s, rstd if rstd is not None else y, n_rows, eps, offset,
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
    overrides the launch shape (:func:`norm_backward_tiling`, which asks the GPU for its SM count; benchmarks
    sweep it).

    Example (on CPU tensors, in Triton's interpreter; one program over the four rows):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> s = torch.randn(4, 64, device=device)
        >>> w = torch.randn(64, device=device)
        >>> dy, ds = torch.randn_like(s), torch.randn_like(s)
        >>> dx, dw = add_rms_norm_backward(dy, ds, s, w, None, 0.0, False, want_dw=True, eps=1e-6,
        ...                                tiling=(4, 64, 4, 1, 4, 1))
        >>> s_, w_ = s.clone().requires_grad_(), w.clone().requires_grad_()
        >>> (s_ * torch.rsqrt(s_.pow(2).mean(-1, keepdim=True) + 1e-6) * w_).backward(dy)
        >>> torch.allclose(dx, s_.grad + ds, atol=1e-4), torch.allclose(dw, w_.grad, atol=1e-4)
        (True, True)
    """
    if (rstd is None) == (eps is None):
        raise ValueError("add_rms_norm_backward takes either the saved rstd or the eps to recompute it, not "
                         f"{'both' if rstd is not None else 'neither'}")
    n_cols = s.shape[-1]
    n_rows = s.numel() // n_cols
    dy = dy.contiguous()
    ds = ds.contiguous() if ds is not None else None
    dx = torch.empty_like(s)
    block_m, block_n, num_warps, programs, rows_per_program, stages = tiling or norm_backward_tiling(
        n_rows, n_cols, s.element_size(), s.get_device())
    partial = s.new_empty((programs, n_cols), dtype=torch.float32)
    _rms_norm_bwd_kernel[(programs,)](
        dy, ds if ds is not None else dy, s, weight, rstd if rstd is not None else dy, dx, partial, n_rows,
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

    Example (on CPU tensors, in Triton's interpreter):
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> partial, out = torch.randn(3, 40, device=device), torch.empty(40, device=device)
        >>> sum_partial_rows(partial, out)
        >>> torch.allclose(out, partial.sum(0), atol=1e-6)
        True
    """
    programs, n_cols = partial.shape
    block_p, block_c, stages, num_warps = tiling or SUM_TILING
    _sum_partials_kernel[(cdiv(n_cols, block_c),)](partial, out, programs, n_cols, block_p, block_c, stages,
                                                   num_warps=num_warps)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor | None,
                      offset: float, gemma: bool, *, want_dw: bool,
                      eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the input and (if ``want_dw``) of the weight, from the saved contiguous input and either its
    saved rstd or (``rstd=None``) the forward's ``eps``, to recompute it.

    The fused residual kernel's backward with no gradient reaching the sum directly is exactly this; the launch
    shape is :func:`norm_backward_tiling`'s, which asks the GPU for its SM count.

    Example (on a GPU):
        >>> x, w = torch.randn(8, 64, device="cuda"), torch.ones(64, device="cuda")  # doctest: +SKIP
        >>> dx, dw = rms_norm_backward(torch.ones_like(x), x, w, None, 0.0, False, want_dw=True,
        ...                            eps=1e-6)  # doctest: +SKIP
        >>> dx.shape, dw.shape  # doctest: +SKIP
        (torch.Size([8, 64]), torch.Size([64]))
    """
    return add_rms_norm_backward(dy, None, x, weight, rstd, offset, gemma, want_dw=want_dw, eps=eps)
