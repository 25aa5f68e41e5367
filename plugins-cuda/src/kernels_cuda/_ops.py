"""CUDA-tuned entry points that pick, per call, between a Triton kernel and a PyTorch-native one.

A kernel is chosen per module, but the fastest implementation depends on the input size: below a measured
crossover the single fused ATen kernel (``F.rms_norm``) wins because a Triton launch costs more on the host
than the whole ATen kernel takes, above it the Triton kernel runs closer to copy bandwidth. Thresholds come from
``benchmarks/results/cuda-rmsnorm-h100-host-path.json`` (H100, torch 2.11, triton 3.6, bf16) and hold for the
RMSNorm and for the residual add + RMSNorm, whose fused kernel shares the RMSNorm backward. Importing this module
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
    "TRITON_RMS_NORM_NARROW_MIN_ELEMENTS_WITH_GRAD",
    "residual_rms_norm",
    "rms_norm",
]

# H100, bf16, after the Triton host path was trimmed (benchmarks/results/cuda-rmsnorm-h100-host-path.json).
# Forward, do_bench with L2 flushed, us: F.rms_norm | Triton
#   [4096, 1024]     13.0 | 10.3      [8192, 1024]  19.1 | 17.8      [131072, 128] 86.3 | 28.9
# Host per call on a tiny input (cuda-host-overhead-h100.json): F.rms_norm 10.4 us, the Triton adapter 18 us.
# From 2**22 elements the Triton kernel's GPU time saving outweighs its extra host time.
# Forward+backward per layer of a chain of 8 (every host cost on the module path counted), us: F.rms_norm | Triton
#   [16384, 1024]   133 | 227      [4096, 4096]  112 | 204      [16384, 2048]  200 | 242
#   [8192, 8192]    482 | 273      [16384, 4096] 457 | 258      [65536, 2048]  752 | 501
# The Triton backward runs as a Python autograd node in the engine's device thread, where the same host work
# measured 1.7x slower than in the main thread; F.rms_norm's native node has none. Only where the GPU time
# dominates (from 2**26 elements, rows of 2048 or more) does the Triton kernel win with autograd. Rows of 256 or
# fewer (Qwen3's per-head q/k norms) are the exception: F.rms_norm is slow on them on the GPU, forward (82 us vs
# 19 at [131072, 128]) and backward. On the H200 (cuda-rmsnorm-h200-host-path.json) the chain there took 208 us
# per layer with F.rms_norm and 120 with Triton, so narrow rows take Triton from 2**24 elements; on the H100 run
# above the two were within 10% (217 vs 239 us).
TRITON_RMS_NORM_MIN_ELEMENTS = 1 << 22
TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = 1 << 26
TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD = 2048
TRITON_RMS_NORM_NARROW_MIN_ELEMENTS_WITH_GRAD = 1 << 24
_NARROW_ROWS = 256
# Under torch.compile the native math is traced instead, for every size: Inductor fuses it with the residual adds
# around it. H200, Qwen3-0.6B shape, bf16, same run (benchmarks/results/cuda-qwen3-h200-compile-variants.json):
# training 76.2k tokens/s with the native RMSNorm vs 74.5k with the Triton kernel as a custom op (RoPE and gated
# MLP Triton in both), prefill 13.6 ms vs 38.8 ms.


def _triton_wins(hidden_states: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether the measured thresholds pick the Triton kernel for this call (``inputs``: every differentiable one)."""
    import torch

    numel, hidden = hidden_states.numel(), hidden_states.shape[-1]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return numel >= TRITON_RMS_NORM_MIN_ELEMENTS
    if hidden <= _NARROW_ROWS:
        return numel >= TRITON_RMS_NORM_NARROW_MIN_ELEMENTS_WITH_GRAD
    return numel >= TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD and hidden >= TRITON_RMS_NORM_MIN_HIDDEN_WITH_GRAD


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` for small inputs and the Triton kernel for large ones.

    Example:
        >>> import torch
        >>> rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if not tracing() and _triton_wins(hidden_states, hidden_states, weight):
        return _triton.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)


def residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm: the native pair (add, ``F.rms_norm``) where :func:`rms_norm` would take
    ``F.rms_norm``, the fused Triton kernel where it would take Triton.

    The fused kernel's backward is the Triton RMSNorm backward, so the same measured thresholds decide. Under
    ``torch.compile`` the Triton adapter decides (a custom op in training graphs, native math for inference).

    Example:
        >>> import torch
        >>> x, residual = torch.randn(4, 64), torch.randn(4, 64)
        >>> normed, new_residual = residual_rms_norm(x, residual, torch.ones(64), eps=1e-6, offset=0.0,
        ...                                          casting="llama")
        >>> torch.equal(new_residual, residual + x)
        True
    """
    if tracing() or _triton_wins(hidden_states, hidden_states, residual, weight):
        return _triton.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
    return _native.residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
