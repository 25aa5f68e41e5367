"""CUDA-tuned entry points that pick, per call, between a Triton kernel and a PyTorch-native one.

A kernel is chosen per module, but the fastest implementation depends on the input size: below a measured
crossover the single fused ATen kernel (``F.rms_norm``) wins because a Triton launch costs more on the host
than the whole ATen kernel takes, above it the Triton kernel runs closer to copy bandwidth. Thresholds come from
``benchmarks/results/rmsnorm-h100.json`` (H100, torch 2.11, triton 3.6, bf16) and hold for the
RMSNorm and for the residual add + RMSNorm, whose fused kernel shares the RMSNorm backward. Importing this module
imports Triton, so a host without it falls back at kernel load time.
"""

from __future__ import annotations

import torch
from kernels_triton.ops import eager_residual_rms_norm
from kernels_triton.ops import eager_rms_norm
from kernels_triton.ops import native_residual_rms_norm
from kernels_triton.ops import native_rms_norm
from kernels_triton.ops import residual_rms_norm as triton_residual_rms_norm
from torch.compiler import is_compiling


__all__ = [
    "TRITON_RMS_NORM_MIN_ELEMENTS",
    "TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD",
    "residual_rms_norm",
    "rms_norm",
]

# H100, bf16, after the Triton host path was trimmed (benchmarks/results/rmsnorm-h100.json).
# Forward, do_bench with L2 flushed, us: F.rms_norm | Triton
#   [4096, 1024]     13.0 | 10.3      [8192, 1024]  19.1 | 17.8      [131072, 128] 86.3 | 28.9
# Host per call on a tiny input (host-overhead-h100.json): F.rms_norm 10.4 us, the Triton adapter 18 us.
# From 2**22 elements the Triton kernel's GPU time saving outweighs its extra host time.
# With autograd: H200, Qwen3-0.6B-shape training step (4 x 2048 tokens, norms of 8.4M elements, q/k norms of 8.4M
# and 16.8M), two paired runs of kernelize with these thresholds against Triton for every norm
# (paired Qwen3-0.6B runs at commit 63b2cd1): 74.1k vs 76.3k and 70.8k vs 78.3k
# tokens/s, so from 2**23 elements with autograd as well. In an isolated chain of 8 RMSNorms, where no other
# work hides the host, the Triton path took ~130 us of host time per layer while its backward was a Python
# autograd node
# (RMSNorm benchmark at commit 63b2cd1); with kernels-triton's C++ autograd nodes it takes 42-52 us
# per added layer at 8.4M-16.8M elements against F.rms_norm's 60-124 (benchmarks/results/rmsnorm-h200.json).
# In a model the matmuls keep the GPU busy while the host catches up.
TRITON_RMS_NORM_MIN_ELEMENTS = 1 << 22
TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = 1 << 23
# Under torch.compile the native math is traced instead, for every size: Inductor fuses it with the residual adds
# around it. H200, Qwen3-0.6B shape, bf16, same run (benchmarks/results/qwen3-compile-variants-h200.json):
# training 76.2k tokens/s with the native RMSNorm vs 74.5k with the Triton kernel as a custom op (RoPE and gated
# MLP Triton in both), prefill 13.6 ms vs 38.8 ms.


def _triton_wins(hidden_states: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the measured thresholds pick the Triton kernel for this call."""
    # Once per norm layer per step: plain attribute tests, no generator.
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD
    return hidden_states.numel() >= TRITON_RMS_NORM_MIN_ELEMENTS


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` for small inputs and the Triton kernel for large ones.

    Example:
        >>> import torch
        >>> rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    # is_compiling itself, not kernels_triton's tracing() wrapper: one Python frame less, once per layer and step.
    if not is_compiling() and _triton_wins(hidden_states, weight):
        return eager_rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    return native_rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)


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
    if is_compiling():
        return triton_residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
    if _triton_wins(hidden_states, weight, residual):
        return eager_residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
    return native_residual_rms_norm(hidden_states, residual, weight, eps=eps, offset=offset, casting=casting)
