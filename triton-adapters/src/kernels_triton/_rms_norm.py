"""RMSNorm through Liger's Triton kernel, standard and offset variants, Llama and Gemma casting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _native
from ._compile import tracing
from ._device import on_device_of


if TYPE_CHECKING:
    import torch

__all__ = ["liger_supports", "rms_norm"]

# Liger's RMSNorm loads a whole row into one block; beyond 64 KiB per row it raises in backward.
_MAX_ROW_BYTES = 65536


def liger_supports(hidden_states: torch.Tensor, weight: torch.Tensor, *, casting: str) -> bool:
    """Whether Liger's kernel reproduces the eager module for these inputs (and rows fit Liger's 64 KiB block).

    Example:
        >>> import torch
        >>> liger_supports(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), casting="llama")
        False
    """
    return (_native.writes_input_dtype(hidden_states, weight, casting=casting)
            and hidden_states.shape[-1] * hidden_states.element_size() <= _MAX_ROW_BYTES)


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm with ``LigerRMSNormFunction``, launched on the input's device.

    ``in_place=False`` always: with ``in_place=True`` Liger overwrites the incoming gradient ``dY`` with ``dX``,
    and a residual branch that still needs ``dY`` then gets a wrong gradient (Liger #370, Gemma2 failed to
    converge). While Dynamo traces this function it returns the native math, so Inductor fuses it and never
    autotunes Liger's kernel (Liger + ``torch.compile`` crashed with an illegal memory access there).

    Example:
        >>> import torch
        >>> x, w = torch.randn(4, 64), torch.ones(64)   # CPU tensors take the native path
        >>> rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([4, 64])
    """
    if tracing() or not liger_supports(hidden_states, weight, casting=casting):
        return _native.rms_norm(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    from liger_kernel.ops import LigerRMSNormFunction

    with on_device_of(hidden_states):
        return LigerRMSNormFunction.apply(hidden_states, weight, eps, offset, casting, False)
