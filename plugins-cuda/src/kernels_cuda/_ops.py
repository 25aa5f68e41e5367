"""CUDA-tuned entry points that pick, per call, between a Liger kernel and a PyTorch-native one.

A kernel is chosen per module, but the fastest implementation depends on the input size: below a measured
crossover a single fused ATen kernel (``F.rms_norm``) wins because Liger's Python-side launch costs dominate,
above it Liger's Triton kernel runs closer to copy bandwidth. Thresholds are measured on an H100 (see
``benchmarks/results/cuda-rmsnorm-*.json``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels_triton import _native
from kernels_triton import _rms_norm


if TYPE_CHECKING:
    import torch

__all__ = ["LIGER_RMS_NORM_MIN_ELEMENTS", "rms_norm"]

# Elements at and above which Liger's RMSNorm is used (placeholder until measured; see the module docstring).
LIGER_RMS_NORM_MIN_ELEMENTS = 1 << 24


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` for small inputs and Liger for large ones.

    Example:
        >>> import torch
        >>> rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if hidden_states.numel() >= LIGER_RMS_NORM_MIN_ELEMENTS:
        return _rms_norm.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
