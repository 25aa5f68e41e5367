"""Scaled dot-product attention over ``torch_npu.npu_fusion_attention`` (the ``attention`` kind)."""

from __future__ import annotations

import torch

from ._torch_npu import load_torch_npu


__all__ = ["CAUSAL_MASK_SIZE", "fusion_attention"]

# sparse_mode 3 ("rightDownCausal", flash-attention's bottom-right alignment) takes a fixed 2048x2048
# upper-triangular mask (True = masked out) and derives the real causal pattern from it for any lengths.
CAUSAL_MASK_SIZE = 2048
_SPARSE_ALL = 0
_SPARSE_RIGHT_DOWN_CAUSAL = 3
_causal_masks: dict[torch.device, torch.Tensor] = {}


def _causal_mask(device: torch.device) -> torch.Tensor:
    mask = _causal_masks.get(device)
    if mask is None:
        ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device)
        mask = _causal_masks[device] = torch.triu(ones, diagonal=1)
    return mask


def fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    masked_out: torch.Tensor | None,
    scale: float,
    dropout_p: float,
    causal: bool,
) -> torch.Tensor:
    """Attention with ``npu_fusion_attention``; returns ``[B, Sq, Hq, D]`` (transformers' attention output layout).

    Args:
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Skv, D]`` with ``Hq % Hkv == 0`` (GQA is native).
        masked_out: ``None`` or a bool mask broadcastable as ``[B or 1, 1 or Hq, Sq, Skv]``, True = masked out
            (the operator's convention, the opposite of SDPA's).
        scale: the softmax scale (``module.scaling``).
        dropout_p: attention dropout probability; the operator takes ``keep_prob = 1 - dropout_p``.
        causal: with no mask, apply the bottom-right aligned causal mask (sparse_mode 3).

    Inputs whose ``[B, S, N, D]`` transpose is contiguous (q/k/v straight out of the projections) are passed in
    BSND layout, which needs no copy and whose output is already transformers' layout; others go as BNSD.

    Example:
        >>> out = fusion_attention(q, k, v, masked_out=None, scale=q.shape[-1] ** -0.5, dropout_p=0.0,
        ...                        causal=True)  # doctest: +SKIP
    """
    npu = load_torch_npu()
    heads = query.shape[1]
    sparse_mode = _SPARSE_ALL
    mask = masked_out
    if mask is None and causal and query.shape[2] > 1:
        mask, sparse_mode = _causal_mask(query.device), _SPARSE_RIGHT_DOWN_CAUSAL
    elif mask is not None:
        # Masks expanded from a padding vector are stride-0 views; the operator reads a dense bool tensor.
        mask = mask.to(torch.bool).contiguous()
        if mask.dim() == 4 and mask.shape[1] not in (1, heads):
            raise ValueError(f"fusion_attention: mask head dim {mask.shape[1]} must be 1 or {heads}")
    bsnd = all(t.transpose(1, 2).is_contiguous() for t in (query, key, value))
    if bsnd:
        query, key, value, layout = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), "BSND"
    else:
        query, key, value, layout = query.contiguous(), key.contiguous(), value.contiguous(), "BNSD"
    out = npu.npu_fusion_attention(
        query, key, value, heads, layout,
        atten_mask=mask, scale=float(scale), keep_prob=1.0 - float(dropout_p), sparse_mode=sparse_mode,
    )[0]
    return out if bsnd else out.transpose(1, 2)
