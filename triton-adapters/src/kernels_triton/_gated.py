"""Gated activations for SwiGLU and GeGLU MLPs through Liger's fused Triton kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _native
from ._compile import tracing
from ._device import on_device_of


if TYPE_CHECKING:
    import torch

__all__ = ["gelu_tanh_mul", "silu_mul"]


def _liger_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # Mixed dtypes promote in eager; Liger would compute in the gate's dtype.
    return gate.is_cuda and gate.dtype == up.dtype and gate.shape == up.shape and not tracing()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``LigerSiLUMulFunction``: one kernel, and only ``gate``/``up`` saved for backward.

    Example:
        >>> import torch
        >>> silu_mul(torch.zeros(2, 4), torch.ones(2, 4)).shape   # CPU: native path
        torch.Size([2, 4])
    """
    if not _liger_ok(gate, up):
        return _native.silu_mul(gate, up)
    from liger_kernel.ops import LigerSiLUMulFunction

    with on_device_of(gate):
        return LigerSiLUMulFunction.apply(gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` with ``LigerGELUMulFunction``.

    Example:
        >>> import torch
        >>> gelu_tanh_mul(torch.zeros(2, 4), torch.ones(2, 4)).shape   # CPU: native path
        torch.Size([2, 4])
    """
    if not _liger_ok(gate, up):
        return _native.gelu_tanh_mul(gate, up)
    from liger_kernel.ops import LigerGELUMulFunction

    with on_device_of(gate):
        return LigerGELUMulFunction.apply(gate, up)
