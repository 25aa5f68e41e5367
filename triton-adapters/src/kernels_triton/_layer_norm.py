"""LayerNorm through Liger's Triton kernel."""

from __future__ import annotations

import torch

from . import _native
from ._compile import tracing
from ._device import on_device_of


__all__ = ["layer_norm"]


def layer_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float
) -> torch.Tensor:
    """LayerNorm with ``LigerLayerNormFunction``; bias-free layers and mixed dtypes use ``F.layer_norm``.

    Example:
        >>> layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), eps=1e-5).shape  # CPU: native path
        torch.Size([2, 8])
    """
    usable = (
        hidden_states.is_cuda
        and bias is not None
        and weight.dtype == hidden_states.dtype == bias.dtype
        and not tracing()
    )
    if not usable:
        return _native.layer_norm(hidden_states, weight, bias, eps=eps)
    from liger_kernel.ops import LigerLayerNormFunction

    with on_device_of(hidden_states):
        return LigerLayerNormFunction.apply(hidden_states, weight, bias, eps)
