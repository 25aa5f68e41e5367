"""Attention per document of a packed batch: one causal SDPA call per document, no dense mask.

Each document's queries see only its own keys, so its attention is an ordinary causal attention over that
document: SDPA's ``is_causal`` kernels (FlashAttention, cuDNN, or the CPU's own) take it without a mask. A sliding
window longer than the document changes nothing; a shorter one gets the document's band as a mask. Any device,
any float dtype; the documents' boundaries are read on the host once per call.

Example:
    >>> import torch
    >>> from kernels_core.portable import packed_attention
    >>> q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> out = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=4, scale=8 ** -0.5, window=None)
    >>> alone = packed_attention(q[3:], k[3:], v[3:], cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
    ...                          max_seqlen=4, scale=8 ** -0.5, window=None)
    >>> torch.allclose(out[3:], alone)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


__all__ = ["packed_attention"]


def _band(length: int, window: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention within each document (``packed_attention`` convention: ``[T, H, D]`` tensors, documents end
    to end at the ``int32`` offsets ``cu_seqlens``; ``window`` tokens seen per query counting itself, or None).

    Grouped-query attention takes ``key`` and ``value`` with fewer heads; they are not repeated.
    """
    groups = query.shape[1] // key.shape[1]
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        # [n, H, D] -> [1, H, n, D]
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        band = None if window is None or end - start <= window else _band(end - start, window, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, is_causal=band is None, scale=scale,
                                             enable_gqa=groups > 1)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs) if outputs else query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
