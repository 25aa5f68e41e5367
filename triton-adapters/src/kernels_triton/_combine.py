"""The MoE experts' combine step: each token's ``K`` expert outputs, taken from expert order, weighted by their
routing weights and summed, in one Triton launch per direction.

Natively this is a gather back to token order, a product with the weights and a sum over the slots, and in
backward two more products, a reduction and a gather, each a pass over ``[tokens * K, hidden]`` rows. Here the
forward reads each expert row once and writes the token's sum; the backward writes each expert row's gradient once
(straight to its place in expert order: no scatter, no atomics) and each weight's gradient, a dot product over the
row, accumulated in float32.

Two paths, one kernel pair: :func:`combine` (an ``autograd.Function``, what eager calls run) and
:func:`combine_op`, the ``kernels_triton::experts_combine`` custom op with its backward op, which
``torch.compile`` traces without a graph break and Inductor leaves as it is.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._custom_op import custom_op
from ._custom_op import dense_like
from ._custom_op import register_backward
from ._launch import cdiv
from ._launch import next_power_of_2


__all__ = ["combine", "combine_backward", "combine_forward", "combine_op"]

_BLOCK = 1024


@triton.jit
def _combine_fwd_kernel(ROWS, POSITION, WEIGHTS, OUT, hidden, K: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token, column block): OUT[token] = sum over k of WEIGHTS[token, k] * ROWS[POSITION[token, k]].
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(K):
        row = tl.load(POSITION + token * K + k).to(tl.int64)
        weight = tl.load(WEIGHTS + token * K + k).to(tl.float32)
        acc += weight * tl.load(ROWS + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token * hidden + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(GRAD, ROWS, POSITION, WEIGHTS, GRAD_ROWS, GRAD_WEIGHTS, hidden, K: tl.constexpr,
                        BLOCK: tl.constexpr):
    # Program token: each slot's row gradient (weight * GRAD[token]) and weight gradient (GRAD[token] . row).
    token = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    for k in tl.static_range(K):
        row = tl.load(POSITION + token * K + k).to(tl.int64)
        weight = tl.load(WEIGHTS + token * K + k).to(tl.float32)
        dot = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, hidden, BLOCK):
            cols = start + offsets
            mask = cols < hidden
            grad = tl.load(GRAD + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            dot += grad * tl.load(ROWS + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(GRAD_ROWS + row * hidden + cols, (weight * grad).to(GRAD_ROWS.dtype.element_ty), mask=mask)
        tl.store(GRAD_WEIGHTS + token * K + k, tl.sum(dot, axis=0).to(GRAD_WEIGHTS.dtype.element_ty))


def _tiling(hidden: int) -> tuple[int, int]:
    # (BLOCK, num_warps): the row in blocks of up to 1024 columns, 256 per warp.
    block = min(_BLOCK, next_power_of_2(hidden))
    return block, max(1, block // 256)


def combine_forward(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """:func:`combine`'s forward, outside autograd (contiguous ``rows`` and ``weights``)."""
    tokens, top_k = weights.shape
    hidden = rows.shape[-1]
    out = rows.new_empty(tokens, hidden)
    block, warps = _tiling(hidden)
    _combine_fwd_kernel[(tokens, cdiv(hidden, block))](rows, position, weights, out, hidden, top_k, block,
                                                       num_warps=warps)
    return out


def combine_backward(grad: torch.Tensor, rows: torch.Tensor, position: torch.Tensor,
                     weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`combine`'s backward, outside autograd: the gradients of ``rows`` and ``weights``."""
    tokens, top_k = weights.shape
    grad_rows, grad_weights = torch.empty_like(rows), torch.empty_like(weights)
    block, warps = _tiling(rows.shape[-1])
    _combine_bwd_kernel[(tokens,)](grad.contiguous(), rows, position, weights, grad_rows, grad_weights,
                                   rows.shape[-1], top_k, block, num_warps=warps)
    return grad_rows, grad_weights


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, position, weights):  # noqa: ANN001, ANN205
        ctx.save_for_backward(rows, position, weights)
        return combine_forward(rows, position, weights)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad_rows, grad_weights = combine_backward(grad, *ctx.saved_tensors)
        return grad_rows, None, grad_weights


def combine(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * rows[position[t * K + k]]`` for ``rows [S, H]`` (the expert outputs in
    expert order), ``position [T * K]`` (where each token's slot landed in that order) and ``weights
    [T, K]``; the output ``[T, H]`` is in the rows' dtype, summed in float32. Differentiable in rows and weights.

    Example:
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors need Triton's interpreter
        >>> rows = torch.arange(8.0, device=device).view(4, 2)
        >>> position, weights = torch.arange(4, device=device), torch.tensor([[1.0, 0.5], [0.0, 2.0]], device=device)
        >>> combine(rows, position, weights).tolist()
        [[1.0, 2.5], [12.0, 14.0]]
    """
    return _Combine.apply(rows.contiguous(), position, weights.contiguous())


@custom_op("experts_combine", fake=lambda rows, _, weights: rows.new_empty(weights.shape[0], rows.shape[-1]))
def combine_op(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """:func:`combine` as the custom op ``torch.compile`` traces (differentiable through its backward op)."""
    return combine_forward(rows.contiguous(), position, weights.contiguous())


@custom_op("experts_combine_backward", fake=lambda grad, rows, _, weights: (dense_like(rows), dense_like(weights)))
def _combine_backward_op(grad: torch.Tensor, rows: torch.Tensor, position: torch.Tensor,
                         weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return combine_backward(grad, rows.contiguous(), position, weights.contiguous())


def _op_grads(saved: tuple, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
    grad_rows, grad_weights = _combine_backward_op(grad, *saved)
    return grad_rows, None, grad_weights


register_backward(combine_op, save=lambda inputs, output: (inputs, ()), grad=_op_grads)
