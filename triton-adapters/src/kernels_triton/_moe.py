"""Mixture-of-experts experts through Liger's fused grouped-GEMM MoE kernel (SwiGLU experts only)."""

from __future__ import annotations

import torch

from . import _experts
from ._compile import tracing
from ._device import on_device_of


__all__ = ["moe_experts_silu"]


def moe_experts_silu(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """transformers 5 ``*Experts.forward`` (SiLU) with ``LigerFusedMoEFunction``.

    Liger wants the routing indices as int32. Liger builds its routing metadata with data-dependent shapes, so
    while Dynamo traces this function (and on CPU) it takes the grouped-product path of
    :mod:`kernels_triton._experts` instead, which traces without graph breaks; the kernel itself is declared
    without ``torch.compile`` support.

    Example:
        >>> x = torch.randn(3, 8)
        >>> moe_experts_silu(x, torch.tensor([[0], [1], [0]]), torch.ones(3, 1),
        ...                  torch.randn(2, 8, 8), torch.randn(2, 8, 4)).shape   # CPU: grouped products
        torch.Size([3, 8])
    """
    usable = (
        hidden_states.is_cuda
        and not tracing()
        and hidden_states.dtype == gate_up_proj.dtype == down_proj.dtype
        and hidden_states.dim() == 2
    )
    if not usable:
        return _experts.moe_experts_silu(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    from liger_kernel.ops import LigerFusedMoEFunction

    with on_device_of(hidden_states):
        out = LigerFusedMoEFunction.apply(
            hidden_states, gate_up_proj, down_proj, top_k_index.to(dtype=torch.int32), top_k_weights
        )
    return out.to(hidden_states.dtype)
