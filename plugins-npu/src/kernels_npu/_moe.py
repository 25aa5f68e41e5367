"""MoE experts over torch_npu's token permute, grouped matmul and swiglu (the ``moe_experts`` kind, ``silu``)."""

from __future__ import annotations

import torch

from ._gmm import grouped_matmul
from ._torch_npu import load_torch_npu


__all__ = ["moe_experts"]


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """transformers 5 ``*Experts.forward`` with SiLU experts, as permute -> GMM -> swiglu -> GMM -> unpermute.

    Tokens are sorted by expert with ``npu_moe_token_permute``, each expert's rows go through the grouped matmul
    (``gate_up_proj`` then ``down_proj``, with ``npu_swiglu`` between: the gate is the first half, as in
    ``chunk(2)``), and ``npu_moe_token_unpermute`` scatters them back, summing each token's ``top_k`` rows weighted
    by ``top_k_weights``. Expert counts are built on the device with ``scatter_add_``: nothing is read back to the
    host. An index equal to the number of experts (transformers' "dropped" sentinel) contributes nothing.

    Example:
        >>> y = moe_experts(h, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj)  # doctest: +SKIP
    """
    npu = load_torch_npu()
    num_experts = gate_up_proj.shape[0]
    dtype = hidden_states.dtype
    valid = top_k_index < num_experts
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat))
    counts = counts[:num_experts]

    permuted, sorted_indices = npu.npu_moe_token_permute(hidden_states, top_k_index)
    hidden = grouped_matmul(permuted, gate_up_proj.to(dtype).transpose(1, 2), counts)
    hidden = npu.npu_swiglu(hidden, dim=-1)
    hidden = grouped_matmul(hidden, down_proj.to(dtype).transpose(1, 2), counts)
    # Sentinel rows sort last and belong to no group, so the grouped matmul leaves them undefined: zero them
    # (a where, not a multiply, so undefined values cannot turn into NaN) and give them zero weight.
    routed_rows = torch.arange(hidden.shape[0], device=hidden.device) < counts.sum()
    hidden = torch.where(routed_rows.unsqueeze(-1), hidden, hidden.new_zeros(()))
    probs = torch.where(valid, top_k_weights, top_k_weights.new_zeros(())).to(dtype)
    return npu.npu_moe_token_unpermute(hidden, sorted_indices, probs=probs)
