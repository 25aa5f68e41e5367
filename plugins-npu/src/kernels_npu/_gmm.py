"""A differentiable grouped matmul over ``torch_npu.npu_grouped_matmul``, which has no autograd of its own."""

from __future__ import annotations

from typing import Any

import torch

from ._torch_npu import load_torch_npu


__all__ = ["grouped_matmul"]

# npu_grouped_matmul parameters: one output tensor for the single x / weight pair (split_item 2, and 3 for dW),
# m-axis grouping (group_type 0: the rows of x are split per expert) or k-axis grouping (2: the contraction
# dimension is, which is what dW = x^T @ dy needs), and per-group counts rather than a cumsum (group_list_type 1).
_SPLIT_SINGLE = 2
_SPLIT_SINGLE_K = 3
_GROUP_M = 0
_GROUP_K = 2
_COUNTS = 1


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        npu = load_torch_npu()
        ctx.save_for_backward(x, weight, counts)
        return npu.npu_grouped_matmul(
            [x], [weight], group_list=counts, split_item=_SPLIT_SINGLE, group_type=_GROUP_M, group_list_type=_COUNTS
        )[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        npu = load_torch_npu()
        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # dX_e = dY_e @ W_e^T: the same m-axis grouping with each expert's weight transposed.
            grad_x = npu.npu_grouped_matmul(
                [grad], [weight.transpose(1, 2)], group_list=counts,
                split_item=_SPLIT_SINGLE, group_type=_GROUP_M, group_list_type=_COUNTS,
            )[0]
        if ctx.needs_input_grad[1]:
            # dW_e = X_e^T @ dY_e: grouping along the contraction (token) axis gives one [K, N] block per expert.
            grad_weight = npu.npu_grouped_matmul(
                [x.t()], [grad], group_list=counts,
                split_item=_SPLIT_SINGLE_K, group_type=_GROUP_K, group_list_type=_COUNTS,
            )[0]
        return grad_x, grad_weight, None


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ weight[e]``, rows sorted by group, differentiable in x and weight.

    Args:
        x: ``[M, K]`` rows sorted by group.
        weight: ``[E, K, N]`` (a transposed view of an ``[E, N, K]`` parameter is fine).
        counts: ``[E]`` int64 rows per group, on x's device; never read on the host.

    Example:
        >>> y = grouped_matmul(permuted, experts.gate_up_proj.transpose(1, 2), counts)  # doctest: +SKIP
    """
    return _GroupedMatmul.apply(x, weight, counts)
