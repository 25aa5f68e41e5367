"""Mixture-of-experts experts (transformers 5 ``*Experts``) as two grouped matrix products, with no host syncs.

Every (token, slot) pair is sorted by expert once; the sorted rows then go through ``gate_up_proj`` and
``down_proj`` with ``torch._grouped_mm`` (one launch per projection for all experts, CUTLASS on Hopper), with the
gated activation between them in one Triton launch per direction (eagerly on a GPU), and the outputs are put
back in token order and summed over the slots with their routing weights (one more Triton launch per direction
on a GPU, ``kernels_triton._combine``, traced as a custom op). The routing metadata (the permutation and each
expert's end offset) comes from ``torch.sort`` and ``torch.searchsorted`` on the
device: no ``.item()``, no ``nonzero``, no shape that depends on the routing, so the same code runs eagerly and
under ``torch.compile(fullgraph=True)``, forward and backward, with nothing to autotune on first use.

bfloat16 is traced as ``torch._grouped_mm`` itself (Inductor lowers it). For float16 and float32, which Inductor
does not lower, the products are traced as this package's ``torch.library`` custom ops with their own backward
(two more grouped products), so compiled graphs never break there either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._compile import tracing
from ._custom_op import custom_op
from ._custom_op import register_backward
from ._device import on_device_of


__all__ = ["experts_forward", "grouped_mm", "moe_experts_gelu_tanh", "moe_experts_silu", "routing"]

_ACTIVATIONS = ("silu", "gelu_tanh")


def routing(
    top_k_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(perm, inverse, rows, ends)``: the (token, slot) pairs sorted by expert, all on the device, no host sync.

    ``perm`` orders the flattened ``[T * K]`` routing by expert (stable, so the result is deterministic) and
    ``inverse`` undoes it, ``rows`` is the token of each sorted pair and ``ends[e]`` (int32) the number of sorted
    pairs routed to experts ``0..e``: the group offsets ``torch._grouped_mm`` takes. An expert no token picked has
    an empty group.

    Example:
        >>> perm, inverse, rows, ends = routing(torch.tensor([[2, 0], [0, 3]]), num_experts=4)
        >>> perm.tolist(), inverse.tolist(), rows.tolist(), ends.tolist()
        ([1, 2, 0, 3], [2, 0, 1, 3], [0, 1, 0, 1], [2, 2, 3, 4])
    """
    flat = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return perm, inverse, perm // top_k_index.shape[-1], ends


def _eager_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    grouped = getattr(F, "grouped_mm", None)
    if grouped is not None:
        return grouped(x, w, offs=offs)
    return torch._grouped_mm(x, w, offs=offs)


@custom_op("experts_grouped_mm", fake=lambda x, w, _: x.new_empty(x.shape[0], w.shape[-1]))
def _gmm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _eager_grouped_mm(x, w, offs)


@custom_op("experts_grouped_mm_backward", fake=lambda grad, x, w, _: (grad.new_empty(x.shape), w.new_empty(w.shape)))
def _gmm_backward_op(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                     offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x [S, K] @ w[e] [K, N] per group: dx = grad @ w[e]^T, dw[e] = x_e^T @ grad_e (zero for an empty group).
    grad_x = _eager_grouped_mm(grad, w.transpose(-2, -1), offs)
    grad_w = _eager_grouped_mm(x.t(), grad, offs)
    return grad_x, grad_w.to(w.dtype)


register_backward(_gmm_op, save=lambda inputs, output: (inputs, ()),
                  grad=lambda saved, grad: (*_gmm_backward_op(grad.contiguous(), *saved), None))


def _gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    # Eagerly on a GPU, one Triton launch per direction over the concatenated projection. The native ops there
    # (activation and product over strided halves, the activation saved, the halves' gradients concatenated)
    # took 9.6 ms of a 108 ms Mixtral-8x7B step on an H100; the kernelized training step gains 5.0% on that shape
    # and 2.1% on Qwen3-30B-A3B's (benchmarks/results/configs-ab-h100.json, run gate-up-activation). Under
    # torch.compile the native math, which Inductor fuses with its neighbours.
    gelu = activation == "gelu_tanh"
    if gate_up.is_cuda and gate_up.is_contiguous() and not tracing():
        from ._gated import gate_up_activation  # imports Triton: GPU tensors only

        with on_device_of(gate_up):
            return gate_up_activation(gate_up, gelu=gelu)
    return _native.gate_up_mul(gate_up, gelu=gelu)


class _Gather(torch.autograd.Function):
    """``x[index]`` where each row of ``x`` is taken ``fan_out`` times and ``inverse`` undoes the gather.

    The backward is a gather too, where the generic indexing backward scatters with atomics: ``grad[inverse]``,
    and with ``fan_out > 1`` the sum of each source row's copies, which on a GPU is the combine kernel with unit
    weights (one pass, no ``[rows * fan_out, hidden]`` intermediate).
    """

    @staticmethod
    def forward(ctx, x, index, inverse, fan_out):  # noqa: ANN001, ANN205
        ctx.save_for_backward(inverse)
        ctx.fan_out = fan_out
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (inverse,) = ctx.saved_tensors
        if ctx.fan_out == 1:
            grad_x = grad.index_select(0, inverse)
        elif grad.is_cuda:
            grad_x = _weighted_sum(grad, inverse, grad.new_ones(inverse.numel() // ctx.fan_out, ctx.fan_out))
        else:
            grad_x = grad.index_select(0, inverse).view(-1, ctx.fan_out, grad.shape[-1]).sum(dim=1)
        return grad_x, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group e] @ w[e]`` for each group, groups ending at ``offs`` (int32); differentiable.

    ``x`` is ``[S, K]``, ``w`` is ``[E, K, N]``. Eagerly and for bfloat16 under ``torch.compile`` this is
    ``torch._grouped_mm``; float16 and float32 are traced as an opaque custom op with its own backward.

    Example:
        >>> x, w = torch.randn(5, 4), torch.randn(2, 4, 4)
        >>> out = grouped_mm(x, w, torch.tensor([2, 5], dtype=torch.int32))
        >>> torch.allclose(out[:2], x[:2] @ w[0], atol=1e-5) and torch.allclose(out[2:], x[2:] @ w[1], atol=1e-5)
        True
    """
    if tracing() and w.dtype != torch.bfloat16:
        return _gmm_op(x, w, offs)
    return _eager_grouped_mm(x, w, offs)


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str,
) -> torch.Tensor:
    """transformers 5 ``*Experts.forward`` (concatenated ``[gate; up]``, no bias) as two grouped products.

    ``hidden_states [T, H]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]``, ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``; ``activation`` is ``"silu"`` or ``"gelu_tanh"``. The output ``[T, H]`` is in the
    hidden dtype; a token's K weighted rows are summed with float32 accumulation (eager adds them one by one in the
    hidden dtype).
    The grouped products need rows of a multiple of 16 bytes (``H``, ``I`` times the element size); other sizes
    take the dense static-shape path (every expert on every token, correct and traceable, ``E`` times the work).

    Example:
        >>> x = torch.randn(3, 8)
        >>> experts_forward(x, torch.tensor([[0], [1], [0]]), torch.ones(3, 1), torch.randn(2, 8, 8),
        ...                 torch.randn(2, 8, 4), activation="silu").shape
        torch.Size([3, 8])
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown experts activation {activation!r}; expected one of {list(_ACTIVATIONS)}")
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    dtype = gate_up_proj.dtype
    if (hidden * dtype.itemsize) % 16 or (down_proj.shape[-1] * dtype.itemsize) % 16:
        return _native.moe_experts_dense(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                 activation=activation)
    _, inverse, rows, ends = routing(top_k_index, gate_up_proj.shape[0])
    x = _Gather.apply(hidden_states.to(dtype), rows, inverse, top_k)
    gate_up = grouped_mm(x, gate_up_proj.transpose(-2, -1), ends)
    out = grouped_mm(_gated_activation(gate_up, activation), down_proj.transpose(-2, -1), ends)
    return _weighted_sum(out, inverse, top_k_weights).to(hidden_states.dtype)


def _weighted_sum(rows: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # sum over k of weights[t, k] * rows[position[t * K + k]], differentiable. On a GPU one Triton launch per
    # direction (kernels_triton._combine) instead of five passes over the [tokens * K, hidden] rows: the kernelized
    # training step gains 6.6% on the Qwen3-30B-A3B shape (K = 8) and 1.3% on Mixtral-8x7B's (K = 2) on an H100
    # (benchmarks/results/configs-ab-h100.json, run experts-combine). Traced as a custom op: Inductor's own fusion
    # of the gather, product and sum ran 3.4x slower than the kernel, and with the op (and the gather backward as
    # this kernel) kernelize + compile gains 2.9% on Qwen3-30B-A3B's shape (run combine-traced). On CPUs a product
    # and a sum over the K slots; not a batched [1, K] @ [K, H] product, whose backward ran as a batched GEMM
    # with K-wide operands (5.7 ms of a 108 ms Mixtral-8x7B step on an H100 at K = 2).
    if rows.is_cuda:
        from . import _combine  # imports Triton: GPU tensors only (Dynamo traces the import too)

        if tracing():
            return _combine.combine_op(rows, position, weights)
        with on_device_of(rows):
            return _combine.combine(rows, position, weights)
    tokens, top_k = weights.shape
    unsorted = rows.index_select(0, position).view(tokens, top_k, rows.shape[-1])
    return (unsorted * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)


def moe_experts_silu(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts (the ``moe_experts`` calling convention, variant ``silu``).

    Example:
        >>> x = torch.randn(3, 8)
        >>> moe_experts_silu(x, torch.tensor([[0], [1], [0]]), torch.ones(3, 1), torch.randn(2, 8, 8),
        ...                  torch.randn(2, 8, 4)).shape
        torch.Size([3, 8])
    """
    return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu")


def moe_experts_gelu_tanh(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """GeGLU (tanh-GELU) experts (the ``moe_experts`` calling convention, variant ``gelu_tanh``).

    Example:
        >>> x = torch.randn(3, 8)
        >>> moe_experts_gelu_tanh(x, torch.tensor([[0], [1], [0]]), torch.ones(3, 1), torch.randn(2, 8, 8),
        ...                       torch.randn(2, 8, 4)).shape
        torch.Size([3, 8])
    """
    return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                           activation="gelu_tanh")
