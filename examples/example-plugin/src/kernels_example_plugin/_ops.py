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
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(F.gelu(x_, approximate=ctx.approximate), x_, grad)
        return dx, None


def gelu_recompute(hidden: torch.Tensor, *, approximate: str) -> torch.Tensor:
    """``F.gelu(hidden, approximate=...)`` with the activation recomputed in backward.

    Example:
        >>> gelu_recompute(torch.zeros(2), approximate="tanh")
        tensor([0., 0.])
    """
    return _GeluRecompute.apply(hidden, approximate)
