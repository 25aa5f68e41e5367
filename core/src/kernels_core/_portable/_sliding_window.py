"""Sliding-window SDPA in query blocks, each attending only to the keys its window can reach.

Example:
    >>> import torch
    >>> from transformers.integrations.sdpa_attention import sdpa_attention_forward
    >>> from kernels_core._portable._sliding_window import banded_sdpa
    >>> q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    >>> i = torch.arange(10)
    >>> band = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - 3))[None, None]  # 3-token window
    >>> attention = torch.nn.Module()
    >>> fast, _ = banded_sdpa(sdpa_attention_forward, attention, q, k, v, band, sliding_window=3)
    >>> plain, _ = sdpa_attention_forward(attention, q, k, v, band, sliding_window=3)
    >>> torch.allclose(fast, plain, atol=1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


__all__ = ["banded_sdpa"]


def _block(mask: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    # A dimension of size 1 broadcasts over all queries (or keys): it is kept whole.
    return mask[..., rows if mask.shape[-2] > 1 else slice(None), cols if mask.shape[-1] > 1 else slice(None)]


def banded_sdpa(sdpa: Callable[..., Any], /, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward`` for a causal sliding-window layer, ``window`` queries at a time.

    A block of queries ``[start, end)`` can attend only to keys in ``[start - window, end)`` under a causal window
    of ``window`` tokens, so each block's SDPA call gets those keys and the matching slice of the layer's own mask:
    about ``S x 2W`` scores instead of ``S x S``. Masked-out keys contribute exactly nothing to a softmax, so the
    result is the same attention. Calls it cannot split (a query longer than the keys, as when decoding from a
    cache; no mask; fewer than three blocks) go to ``sdpa`` whole.
    """
    window = sliding_window
    length = query.shape[-2]
    if (window is None or attention_mask is None or attention_mask.dim() != 4 or key.shape[-2] != length
            or length <= 2 * window):
        return sdpa(module, query, key, value, attention_mask, *args, sliding_window=sliding_window, **kwargs)
    outputs = []
    for start in range(0, length, window):
        end = min(start + window, length)
        first = max(0, start - window)
        out, _ = sdpa(module, query[:, :, start:end], key[:, :, first:end], value[:, :, first:end],
                      _block(attention_mask, slice(start, end), slice(first, end)), *args,
                      sliding_window=sliding_window, **kwargs)
        outputs.append(out)
    # sdpa_attention_forward returns [batch, queries, heads, head_dim].
    return torch.cat(outputs, dim=1), None
