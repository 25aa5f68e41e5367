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

__all__ = [
    "TRITON_RMS_NORM_MIN_ELEMENTS",
    "TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD",
    "TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD",
    "rms_norm",
]

# Median microseconds on the H200, bf16 (benchmarks/results/cuda-rmsnorm-h200.json), forward | forward+backward:
#   [8192, 1024]    F.rms_norm 16.7 | 128   Triton 13.7 | 560
#   [131072, 128]   F.rms_norm 84.4 | 210   Triton 43.6 | 684   (narrow rows: F.rms_norm's forward is slow)
#   [8192, 8192]    F.rms_norm 105  | 368   Triton 70.8 | 486
#   [32768, 4096]   F.rms_norm 157  | 599   Triton 134  | 491
#   [32768, 8192]   F.rms_norm 399  | 1429  Triton 264  | 791   (Triton 96% of copy bandwidth)
# Without autograd the Triton kernel wins from 2**23 elements. With autograd its backward has a host-side floor
# of several hundred microseconds (as Liger's does), so F.rms_norm keeps everything below 2**27 elements and
# rows narrower than 4096.
TRITON_RMS_NORM_MIN_ELEMENTS = 1 << 23
TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = 1 << 27
TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD = 4096


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

    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        use_triton = (hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD
                      and hidden_states.shape[-1] >= TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD)
    else:
        use_triton = hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS
    if use_triton:
        return _triton.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
