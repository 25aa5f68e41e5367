"""Rotary position embedding over ``torch_npu.npu_rotary_mul`` (``rotary_embedding`` kind, ``full``/``partial``)."""

from __future__ import annotations

import torch

from ._torch_npu import load_torch_npu


__all__ = ["apply_rotary"]


def _rotate(npu: object, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    # npu_rotary_mul wants r1/r2 in x's dtype; transformers already builds them so, this only guards odd callers.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rotary == x.shape[-1]:
        return npu.npu_rotary_mul(x, cos, sin, "half")
    # The operator rotates the whole head dimension; partial rotary rotates the first `rotary` dims only.
    rotated = npu.npu_rotary_mul(x[..., :rotary], cos, sin, "half")
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` with ``npu_rotary_mul(x, cos, sin, "half")``.

    ``half`` mode is HF ``rotate_half`` pairing (``cat(-x2, x1)``). When ``cos`` is narrower than the head
    dimension (partial rotary: Phi-3-style ``partial_rotary_factor``), the leading slice is rotated and the rest
    passed through, as the ``partial`` variant requires. Outputs keep q's and k's dtypes.

    Example:
        >>> q_embed, k_embed = apply_rotary(q, k, cos, sin)  # doctest: +SKIP
    """
    npu = load_torch_npu()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary = cos.shape[-1]
    if rotary > q.shape[-1] or rotary % 2:
        raise ValueError(f"apply_rotary: rotary dim {rotary} must be even and at most the head dim {q.shape[-1]}")
    return _rotate(npu, q, cos, sin), _rotate(npu, k, cos, sin)
