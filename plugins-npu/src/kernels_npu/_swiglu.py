"""SiLU-gated product over ``torch_npu.npu_swiglu`` (the ``silu_gated_mlp`` kind, variants ``split`` and ``fused``)."""

from __future__ import annotations

import torch

from ._torch_npu import load_torch_npu


__all__ = ["silu_mul"]


def _adjacent_halves(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose last-dim halves are exactly ``gate`` and ``up``, if they are such views of one base.

    A fused ``gate_up_proj`` output chunked in two gives exactly that; handing the base to ``npu_swiglu`` saves the
    concatenation copy. Gradients still reach the projection, because the views were slices of that base.
    """
    base = gate._base
    if base is None or up._base is not base or not base.is_contiguous() or base.dim() != gate.dim():
        return None
    width = gate.shape[-1]
    if base.shape[:-1] != gate.shape[:-1] or base.shape[-1] != 2 * width or up.shape != gate.shape:
        return None
    if gate.stride() != base.stride() or up.stride() != base.stride():
        return None
    if gate.storage_offset() != base.storage_offset() or up.storage_offset() != base.storage_offset() + width:
        return None
    return base


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``npu_swiglu``, which gates with the *first* half of its input along ``dim``.

    ``npu_swiglu`` takes one contiguous tensor with an even last dimension, so the two halves are concatenated
    (gate first) unless they already are the two halves of one contiguous tensor.

    Example:
        >>> out = silu_mul(mlp.gate_proj(x), mlp.up_proj(x))  # doctest: +SKIP
    """
    npu = load_torch_npu()
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    packed = _adjacent_halves(gate, up)
    if packed is None:
        packed = torch.cat((gate, up), dim=-1)
    return npu.npu_swiglu(packed, dim=-1)
