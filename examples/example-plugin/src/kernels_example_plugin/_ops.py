"""GELU that saves its input only and recomputes itself in backward (same math, less saved memory)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


__all__ = ["gelu_recompute"]


class _GeluRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        # ATen's own GELU derivative: what eager autograd computes, and traceable by torch.compile (a nested
        # torch.autograd.grad is not).
        return torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate), None


def gelu_recompute(hidden: torch.Tensor, *, approximate: str) -> torch.Tensor:
    """``F.gelu(hidden, approximate=...)`` with the activation recomputed in backward.

    Example:
        >>> gelu_recompute(torch.zeros(2), approximate="tanh")
        tensor([0., 0.])
    """
    return _GeluRecompute.apply(hidden, approximate)
