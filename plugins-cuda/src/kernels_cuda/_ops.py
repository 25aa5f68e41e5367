"""CUDA-tuned entry points that pick, per call, between a Liger kernel and a PyTorch-native one.

A kernel is chosen per module, but the fastest implementation depends on the input size: below a measured
crossover a single fused ATen kernel (``F.rms_norm``) wins because Liger's Python-side launch costs dominate,
above it Liger's Triton kernel runs closer to copy bandwidth. Thresholds come from
``benchmarks/results/cuda-rmsnorm-h200.json`` (H200, torch 2.11, triton 3.6, liger-kernel 0.8.5, bf16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels_triton import _native
from kernels_triton import _rms_norm


if TYPE_CHECKING:
    import torch

__all__ = [
    "LIGER_RMS_NORM_MIN_ELEMENTS",
    "LIGER_RMS_NORM_MIN_HIDDEN",
    "LIGER_RMS_NORM_MIN_HIDDEN_WITH_GRAD",
    "rms_norm",
]

# Median microseconds on the H200, bf16, forward | forward+backward:
#   [8192, 1024]   F.rms_norm 16.8 | 137   Liger 78.6 | 605   (Liger's Python-side launch costs dominate)
#   [131072, 128]  F.rms_norm 85.2 | 211   Liger 46.9 | 549   (Qwen3 q/k norm in training: backward decides)
#   [8192, 8192]   F.rms_norm 106  | 368   Liger 95.9 | 540
#   [65536, 2048]  F.rms_norm 155  | 614   Liger 140  | 743   (narrow rows: Liger's backward loses)
#   [32768, 4096]  F.rms_norm 157  | 607   Liger 133  | 573
#   [32768, 8192]  F.rms_norm 400  | 1431  Liger 268  | 948   (Liger 94% of copy bandwidth)
# A second run gave [32768, 4096] forward+backward as Liger 817 vs F.rms_norm 598: Liger's backward has a
# ~500 us host-side floor, so with autograd Liger is used only for rows of 8192 or more (consistently 1.5x faster
# there); without autograd Liger's forward wins from 2**27 elements with rows of 4096.
LIGER_RMS_NORM_MIN_ELEMENTS = 1 << 27
LIGER_RMS_NORM_MIN_HIDDEN = 4096
LIGER_RMS_NORM_MIN_HIDDEN_WITH_GRAD = 8192


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` for small inputs and Liger for large ones.

    Example:
        >>> import torch
        >>> rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    import torch

    grad = torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
    min_hidden = LIGER_RMS_NORM_MIN_HIDDEN_WITH_GRAD if grad else LIGER_RMS_NORM_MIN_HIDDEN
    if hidden_states.numel() >= LIGER_RMS_NORM_MIN_ELEMENTS and hidden_states.shape[-1] >= min_hidden:
        return _rms_norm.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
