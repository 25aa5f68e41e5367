"""Attention under a boolean mask, computed block-sparse by FlexAttention where torch.compile traces it.

transformers hands SDPA a dense ``[B, 1, S, S]`` mask for packed rows and padded batches; SDPA then computes every
score of the square. Under torch.compile, FlexAttention computes the same masked softmax from a block mask: a
``128 x 128`` tile the mask hides entirely is skipped, one it shows entirely is computed without reading the mask.
Packed documents of 2,048 tokens in a row of 8,192 leave an eighth of the square to compute.

Example:
    >>> import torch
    >>> from kernels_core._portable._masked_attention import masked_attention
    >>> q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    >>> i, doc = torch.arange(6), torch.tensor([0, 0, 0, 1, 1, 1])
    >>> mask = (i[:, None] >= i[None]) & (doc[:, None] == doc[None])
    >>> masked_attention(q, k, v, mask=mask[None], scale=8 ** -0.5).shape
    torch.Size([1, 2, 6, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


__all__ = ["masked_attention"]

# Where torch.compile lowers FlexAttention, forward and backward, to a kernel and it was measured to pay (CUDA:
# benchmarks/cuda/packing_bench.py). Elsewhere (CPU has no FlexAttention backward), and eagerly, where
# FlexAttention runs its reference implementation, SDPA computes the masked attention itself.
_FLEX_DEVICES = ("cuda",)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale)`` over the keys ``mask`` shows each query, times ``v`` (``packed_attention``'s
    ``masked`` convention: ``[B, H, S, D]`` tensors, ``mask`` a boolean ``[B or 1, S, S]``).

    Grouped-query attention takes ``key`` and ``value`` with fewer heads; they are not repeated. A query the mask
    shows no key gets zeros, as SDPA gives it.
    """
    gqa = query.shape[1] != key.shape[1]
    if not torch.compiler.is_compiling() or query.device.type not in _FLEX_DEVICES:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None], scale=scale,
                                              enable_gqa=gqa)
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    def shown(batch: torch.Tensor, head: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
        return mask[batch, q_index, kv_index]

    length = query.shape[-2]
    block_mask = create_block_mask(shown, mask.shape[0], None, length, key.shape[-2], device=query.device)
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
