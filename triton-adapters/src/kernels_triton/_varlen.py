"""Packed rows through FlashAttention's variable-length kernel, as PyTorch ships it (``torch.nn.attention.varlen``).

One launch per direction for every document of the batch, no mask and no padding: the ``packed_attention``
convention (``core/docs/kernel-conventions.md``) is the variable-length layout itself. Grouped-query attention keeps
keys and values unrepeated where ``varlen_attn`` takes ``enable_gqa`` (PyTorch 2.12 on); before that they are
repeated per query head. A sliding window needs ``window_size`` (2.11 on). Inputs the kernel cannot take (not on
a GPU, float32, a window this PyTorch cannot express, a head size over 256) go to the core's portable kernel,
one causal SDPA call per document, which computes the same attention.
"""

from __future__ import annotations

import functools
import inspect

import torch


__all__ = ["varlen_attention"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention within each document of a packed batch (``packed_attention`` convention).

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(6, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
        >>> cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        >>> varlen_attention(q, k, v, cu_seqlens=cu, max_seqlen=4, scale=8 ** -0.5, window=None).shape
        torch.Size([6, 2, 8])
    """
    parameters = _parameters() if query.is_cuda else frozenset()
    if (not query.is_cuda or query.dtype not in _FLASH_DTYPES or query.shape[-1] > 256
            or (window is not None and "window_size" not in parameters)):
        from kernels_core.portable import packed_attention

        return packed_attention(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale,
                                window=window)
    from torch.nn.attention.varlen import varlen_attn

    options: dict[str, object] = {"scale": scale}
    if "window_size" in parameters:
        options["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        options["is_causal"] = True
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)
