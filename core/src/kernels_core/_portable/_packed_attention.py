"""Attention per document of a packed batch: causal SDPA over each document, no dense mask.

Each document's queries see only its own keys, so its attention is an ordinary causal attention over that
document: SDPA's ``is_causal`` kernels (FlashAttention, cuDNN, or the CPU's own) take it without a mask. Documents
of one length (a packer that cuts a stream into equal blocks, or equal samples) are one batch ``[N, H, L, D]``
and take a single SDPA call; others take one call each, their boundaries read on the host once per call. A sliding
window longer than the document changes nothing; a shorter one gets the document's band as a mask. Any device,
any float dtype.

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


__all__ = ["document_bounds", "equal_documents", "packed_attention", "remember_bounds"]

# Where the offsets read back to the host are kept: on the cu_seqlens tensor, which every layer of one forward
# shares, so a kernel that needs them as Python ints reads them once a forward, not once a layer.
_BOUNDS_ATTR = "_kernels_core_bounds"


def remember_bounds(cu_seqlens: torch.Tensor, bounds: list[int]) -> None:
    """Keep ``bounds`` (``cu_seqlens`` as Python ints, already on the host) for :func:`document_bounds`."""
    cu_seqlens.__dict__[_BOUNDS_ATTR] = (cu_seqlens._version, bounds)


def document_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """The document offsets as Python ints: read from the device once per tensor (and kept on it), or given by
    whoever built the tensor from offsets it already had on the host.

    Example:
        >>> import torch
        >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        >>> document_bounds(cu)
        [0, 3, 8]
        >>> remember_bounds(cu, [0, 3, 8]); document_bounds(cu)
        [0, 3, 8]
    """
    version, bounds = cu_seqlens.__dict__.get(_BOUNDS_ATTR, (None, None))
    if bounds is None or version != cu_seqlens._version:
        bounds = cu_seqlens.tolist()
        remember_bounds(cu_seqlens, bounds)
    return bounds


def equal_documents(query: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> bool:
    """Whether every document has ``max_seqlen`` tokens, known from shapes alone (no device-to-host copy).

    ``N`` documents of at most ``max_seqlen`` tokens fill ``N * max_seqlen`` tokens only if each has exactly that.

    Example:
        >>> import torch
        >>> equal_documents(torch.empty(8, 2, 4), torch.tensor([0, 4, 8], dtype=torch.int32), 4)
        True
        >>> equal_documents(torch.empty(8, 2, 4), torch.tensor([0, 3, 8], dtype=torch.int32), 5)
        False
    """
    documents = cu_seqlens.shape[0] - 1
    return documents > 0 and max_seqlen > 0 and documents * max_seqlen == query.shape[0]


def _band(length: int, window: int, device: torch.device) -> torch.Tensor | None:
    if window >= length:
        return None
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
            window: int | None) -> torch.Tensor:
    """Causal SDPA over ``[N, L, H, D]`` documents of one length, returned as ``[N, L, H, D]``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    band = None if window is None else _band(q.shape[-2], window, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, is_causal=band is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention within each document (``packed_attention`` convention: ``[T, H, D]`` tensors, documents end
    to end at the ``int32`` offsets ``cu_seqlens``; ``window`` tokens seen per query counting itself, or None).

    Grouped-query attention takes ``key`` and ``value`` with fewer heads; they are not repeated.
    """
    if equal_documents(query, cu_seqlens, max_seqlen):
        # [T, H, D] -> [N, L, H, D]: a view, so one call covers every document.
        shaped = [t.unflatten(0, (-1, max_seqlen)) for t in (query, key, value)]
        return _causal(*shaped, scale=scale, window=window).flatten(0, 1)
    outputs = []
    bounds = document_bounds(cu_seqlens)
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        outputs.append(_causal(*(t[None, start:end] for t in (query, key, value)), scale=scale, window=window)[0])
    return torch.cat(outputs) if outputs else query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
