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
from kernels_triton._compile import tracing


if TYPE_CHECKING:
    import torch

__all__ = [
    "TRITON_RMS_NORM_MIN_ELEMENTS",
    "TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD",
    "TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD",
    "rms_norm",
]

# H200, bf16, microseconds (benchmarks/results/cuda-rmsnorm-h200.json). Forward on the GPU alone (CUDA graphs) |
# forward as called (do_bench, host work included) | forward+backward as called:
#   [8192, 1024]    F.rms_norm 14.1 | 17.0 | 123    Triton 10.8 | 27.2 | 536   (host-bound: 28 us of host work)
#   [16384, 1024]   F.rms_norm 25.0 | 28.2 | 147    Triton 18.8 | 22.2 | 450
#   [131072, 128]   F.rms_norm 83.3 | 85.2 | 213    Triton 19.8 | 44.1 | 610   (narrow rows: F.rms_norm is slow)
#   [4096, 4096]    F.rms_norm 24.6 | 28.3 |  95    Triton 18.6 | 22.4 | 483
#   [32768, 4096]   F.rms_norm 156  | 159  | 596    Triton 132  | 135  | 705 (another run: 389 vs 601)
#   [32768, 8192]   F.rms_norm 401  | 404  | 1396   Triton 261  | 264  | 807 (another run: 800 vs 1431)
# Without autograd the Triton kernel is faster on the GPU from 2**23 elements, but below 2**24 its host-side
# launch (28 us against F.rms_norm's 10 us) decides when the host is the bottleneck, so it takes over from 2**24.
# With autograd its backward carries a host-side floor of several hundred microseconds (as Liger's does) whose
# run-to-run spread reaches 2x: only from 2**28 elements with rows of 4096 or more does it win in every run.
TRITON_RMS_NORM_MIN_ELEMENTS = 1 << 24
TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = 1 << 28
TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD = 4096
# Under torch.compile the native math is traced instead, for every size: Inductor fuses it with the residual adds
# around it. H200, Qwen3-0.6B shape, bf16, same run (benchmarks/results/cuda-qwen3-h200-compile-variants.json):
# training 76.2k tokens/s with the native RMSNorm vs 74.5k with the Triton kernel as a custom op (RoPE and gated
# MLP Triton in both), prefill 13.6 ms vs 38.8 ms.


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

    if tracing():
        return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        use_triton = (hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD
                      and hidden_states.shape[-1] >= TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD)
    else:
        use_triton = hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS
    if use_triton:
        return _triton.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
