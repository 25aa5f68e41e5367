"""Rotary position embedding through Liger's Triton kernel (full and partial rotation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _native
from ._compile import tracing
from ._device import on_device_of


if TYPE_CHECKING:
    import torch

__all__ = ["rotary_embedding"]


def _private_copy(x: torch.Tensor) -> torch.Tensor:
    # Liger rotates in place whenever x.transpose(1, 2) is contiguous (the usual [B, S, H, D] projection layout).
    # The calling convention returns new tensors like eager does, so give Liger a copy of its own then; in the
    # other layouts Liger's own .contiguous() already copies.
    if x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).clone().transpose(1, 2)
    return x


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` with ``LigerRopeFunction``; the inputs are never modified.

    Partial rotation (``cos.shape[-1] < head_dim``) is handled by Liger >= 0.8.5's ``rotary_dim``. Layouts Liger
    does not take (``unsqueeze_dim != 1``, cos/sin in another dtype, which promotes in eager) use the native math.

    Example:
        >>> import torch
        >>> q = k = torch.randn(1, 2, 3, 4)
        >>> out = rotary_embedding(q, k, torch.ones(1, 3, 4), torch.zeros(1, 3, 4))  # CPU: native path
        >>> torch.equal(out[0], q)
        True
    """
    usable = (
        q.is_cuda
        and not tracing()
        and unsqueeze_dim == 1
        and q.dim() == 4
        and cos.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= q.shape[-1]
    )
    if not usable:
        return _native.rotary_embedding(q, k, cos, sin, unsqueeze_dim)
    from liger_kernel.ops import LigerRopeFunction

    with on_device_of(q):
        return LigerRopeFunction.apply(_private_copy(q), _private_copy(k), cos, sin, None, 1, cos.shape[-1])
