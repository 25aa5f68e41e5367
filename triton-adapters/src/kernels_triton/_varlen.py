"""Packed rows through FlashAttention's variable-length kernel, as PyTorch ships it.

One launch per direction for every document of the batch, no mask and no padding: the ``packed_attention``
convention (``core/docs/kernel-conventions.md``) is the variable-length layout itself. The kernel is called through
ATen's ``_flash_attention_forward``, the operator ``torch.nn.attention.varlen.varlen_attn`` wraps: its autograd is
ATen's own (C++), and FlashAttention takes grouped-query heads as they are. On an H200 (torch 2.11, Qwen3-0.6B
attention, 4 documents of 2,048 tokens) that costs 22 us of host time per forward call where ``varlen_attn``'s
Python custom op costs 170-430 us, and keys and values are not repeated per query head (``varlen_attn`` takes
``enable_gqa`` only from 2.12). Inputs the kernel cannot take (not on a GPU, float32, a head size over 256, a torch
without the operator) go to the core's portable kernel, causal SDPA per document, which computes the same
attention; so do documents all of one length that no window cuts, which that kernel computes as one dense causal
batch, at the speed of an unpacked one.
"""

from __future__ import annotations

import torch
from kernels_core.portable import equal_documents
from kernels_core.portable import packed_attention


__all__ = ["varlen_attention"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


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
    if (not query.is_cuda or query.dtype not in _FLASH_DTYPES or query.shape[-1] > 256
            or not hasattr(torch.ops.aten, "_flash_attention_forward")
            or (equal_documents(query, cu_seqlens, max_seqlen) and (window is None or window >= max_seqlen))):
        # Documents of one length with nothing cut by a window are one dense causal batch: SDPA's cuDNN kernel
        # (the one an unpacked batch gets) ran forward + backward in 0.68 ms where the varlen kernel took 1.17 ms
        # (H200, torch 2.11, 4 x 2,048 tokens, 16 query and 8 key heads of 128).
        return packed_attention(query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale,
                                window=window)
    # (-1, 0) is causal without a window; (window - 1, 0) lets a query see itself and the window - 1 tokens before.
    left = -1 if window is None else window - 1
    output, *_ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=0)
    return output
