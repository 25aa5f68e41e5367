"""SiLU-gated product ``silu(gate) * up`` that keeps one activation fewer alive for backward than eager.

Eager autograd saves ``gate`` (for SiLU's backward), ``silu(gate)`` and ``up`` (for the product's backward).
This function saves only ``gate`` and ``up`` and recomputes ``silu(gate)`` in backward: one
``[tokens, intermediate]`` tensor less per MLP layer, for one extra elementwise op. The backward uses the
same ATen ``silu_backward`` as eager and the same recomputed ``silu(gate)``, so gradients are bit-identical.

Example:
    >>> import torch
    >>> from kernels_core._portable._silu_mul import silu_mul
    >>> gate, up = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    >>> bool(torch.equal(silu_mul(gate, up), torch.nn.functional.silu(gate) * up))
    True
"""

from __future__ import annotations

import torch
from torch.nn import functional as F  # noqa: N812 - the conventional alias


__all__ = ["silu_mul"]


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad
        grad_gate = torch.ops.aten.silu_backward(grad_output * up, gate) if need_gate else None
        grad_up = grad_output * F.silu(gate) if need_up else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the input dtype, following the ``silu_gated_mlp`` convention.

    Example:
        >>> import torch
        >>> silu_mul(torch.zeros(2), torch.ones(2))
        tensor([0., 0.])
    """
    return _SiluMul.apply(gate, up)
