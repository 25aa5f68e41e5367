"""CUDA-tuned entry points that pick, per call, between a Triton kernel and a PyTorch-native one.

A kernel is chosen per module, but the fastest implementation depends on the input size: below a measured
crossover the single fused ATen kernel (``F.rms_norm``) wins because any Triton launch costs more on the host
than the whole ATen kernel takes, above it the Triton kernel runs closer to copy bandwidth. Thresholds come from
``benchmarks/results/cuda-rmsnorm-h200.json`` (H200, torch 2.11, triton 3.6, bf16); importing this module
imports Triton, so a host without it falls back at kernel load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels_triton import _native
from kernels_triton import _triton


if TYPE_CHECKING:
    import torch

__all__ = ["TRITON_RMS_NORM_MIN_ELEMENTS", "TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD", "rms_norm"]

# Smallest input (elements) from which the Triton RMSNorm beats F.rms_norm, without and with autograd.
TRITON_RMS_NORM_MIN_ELEMENTS = 1 << 22
TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = 1 << 22


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` for small inputs and the Triton kernel for large ones.

    Example:
        >>> import torch
        >>> rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    import torch

    grad = torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
    threshold = TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD if grad else TRITON_RMS_NORM_MIN_ELEMENTS
    if hidden_states.numel() >= threshold:
        return _triton.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
