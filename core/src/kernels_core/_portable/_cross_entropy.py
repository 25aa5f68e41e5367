"""Chunked fused linear cross-entropy: the causal-LM loss without ever materializing ``[tokens, vocab]`` logits.

Eager training computes ``logits = lm_head(hidden)`` for every token, upcasts them to float32, and keeps them
(and their gradient, and ``log_softmax``'s output) alive until backward: with a 151,936-token vocabulary that
is several times the size of the whole model. Here the forward pass walks the tokens in chunks, and for each
chunk computes the logits, the loss rows and *already* the gradients w.r.t. the hidden states and the LM-head
weight (the softmax minus the one-hot target is all the backward needs). Only one chunk of logits is alive at
any time; backward merely scales the stored gradients by ``grad_output``.

Example:
    >>> import torch
    >>> from kernels_core._portable._cross_entropy import fused_linear_cross_entropy
    >>> hidden = torch.randn(10, 8, requires_grad=True)
    >>> weight = torch.randn(32, 8, requires_grad=True)
    >>> labels = torch.tensor([1, 2, -100, 4, 5, 6, 7, 8, 9, 10])
    >>> loss = fused_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100,
    ...                                   num_items_in_batch=None, softcap=None)
    >>> loss.backward()
    >>> loss.dtype, hidden.grad.shape, weight.grad.shape
    (torch.float32, torch.Size([10, 8]), torch.Size([32, 8]))
"""

from __future__ import annotations

import torch
from torch.nn import functional as F  # noqa: N812 - the conventional alias


__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "chunk_rows",
    "fused_linear_cross_entropy",
]

DEFAULT_MEMORY_BUDGET = 256 * 2**20
"""Bytes of per-chunk logit work space (256 MiB).

Chosen so that, for a 151,936-token vocabulary, a chunk holds ~220 tokens: big enough that the three GEMMs
per chunk keep a CPU or GPU busy, small enough that the chunk is a minor part of peak memory on a laptop.
"""

# float32 logits (reused in place for the softmax and its gradient) + their cast copy for the gradient GEMMs +
# softcap's float32 tanh, per logit; the model-dtype GEMM output is freed before the cast copy exists.
_WORK_BYTES_PER_LOGIT = 12
# Multiples of 16 rows keep GEMM tiles full on tensor-core hardware; harmless elsewhere.
_ROW_ALIGN = 16
# Elements per float32 scratch block when backward scales a half-precision gradient (16 MiB).
_SCALE_BLOCK = 2**22


def chunk_rows(num_tokens: int, vocab_size: int, *, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> int:
    """How many tokens one chunk processes so that its logit work space stays within ``memory_budget`` bytes.

    Example:
        >>> chunk_rows(8192, 151936)
        144
        >>> chunk_rows(5, 151936)
        5
    """
    if num_tokens <= 0:
        return 1
    rows = memory_budget // (_WORK_BYTES_PER_LOGIT * max(vocab_size, 1))
    rows = max(_ROW_ALIGN, rows - rows % _ROW_ALIGN)
    return min(rows, num_tokens)


def _float32_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, logit_scale: float | None,
                    softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's float32 logits as eager computes them, and ``tanh(logits / softcap)`` where soft-capped.

    Example:
        >>> logits, tanh = _float32_logits(torch.ones(2, 3), torch.ones(4, 3), None, logit_scale=0.5, softcap=None)
        >>> logits.dtype, logits[0, 0].item(), tanh
        (torch.float32, 1.5, None)
    """
    # Same op and dtype as eager `lm_head(hidden)`, then the same float32 upcast as ForCausalLMLoss.
    logits = F.linear(h, weight, bias)
    if logit_scale is not None:
        # Command-R's multiplier, Granite's divisor (as 1 / logits_scaling): in the logits' dtype, before the upcast,
        # as eager scales them, so half-precision logits get eager's rounding of the product (in place: no second
        # chunk of logits).
        logits.mul_(logit_scale)
    logits = logits.float()
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(logits.div_(softcap))
        logits = torch.mul(tanh, softcap, out=logits)
    return logits, tanh


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both input gradients computed chunk by chunk in forward; backward only rescales them."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        num_items_in_batch: torch.Tensor | int | float | None,
        softcap: float | None,
        rows_per_chunk: int,
        logit_scale: float | None = None,
    ) -> torch.Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        device = hidden.device
        num_tokens = hidden.shape[0]
        labels = labels.to(device=device, dtype=torch.long)
        valid = labels != ignore_index
        # Gather needs an in-range index; ignored rows are zeroed by the mask anyway.
        targets = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)

        # transformers: reduction="sum" then `/ num_items_in_batch` when given, else "mean" over valid rows.
        if num_items_in_batch is None:
            denominator = valid.sum().to(torch.float32)
        else:
            denominator = torch.as_tensor(num_items_in_batch, device=device).to(torch.float32)
        # where() rather than valid/denominator: an all-ignored batch must give zero gradients (as eager
        # cross_entropy does), not 0 * inf = nan.
        row_scale = torch.where(valid, 1.0 / denominator, torch.zeros((), device=device, dtype=torch.float32))

        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight gradient in float32 across chunks so low-precision weights get one rounding,
        # like eager's single GEMM, instead of one per chunk.
        grad_weight = torch.zeros(weight.shape, device=device, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], device=device, dtype=torch.float32) if need_bias else None

        for start in range(0, num_tokens, rows_per_chunk):
            stop = min(start + rows_per_chunk, num_tokens)
            h = hidden[start:stop]
            logits, tanh = _float32_logits(h, weight, bias, logit_scale=logit_scale, softcap=softcap)
            target_logit = logits.gather(1, targets[start:stop])
            # logsumexp by hand, in place: the exponentials are reused as the softmax numerator, so one
            # [chunk, V] float32 buffer serves the loss and the gradient.
            row_max = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(row_max).exp_()
            row_sum = exp.sum(dim=-1, keepdim=True)
            lse = row_max + row_sum.log()
            loss_sum = loss_sum + ((lse - target_logit).squeeze(1) * valid[start:stop]).sum()
            if not (need_hidden or need_weight or need_bias):
                continue

            # d loss / d logits = (softmax - onehot) * row_scale, built in place.
            grad_logits = exp.div_(row_sum)
            grad_logits.scatter_add_(1, targets[start:stop], torch.full_like(target_logit, -1.0))
            grad_logits.mul_(row_scale[start:stop].unsqueeze(1))
            if tanh is not None:
                grad_logits.mul_(tanh.square_().neg_().add_(1.0))
                del tanh
            if logit_scale is not None:
                grad_logits.mul_(logit_scale)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
            if grad_weight is not None:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(torch.mm(grad_logits.t(), h))

        loss = loss_sum / denominator
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return loss

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # In place: a copy of the [V, H] weight gradient would be the largest allocation of the whole loss.
        # The stored gradients serve exactly one backward; a second one (retain_graph=True) is refused by
        # autograd's version check on the saved tensors instead of silently scaling twice.
        scaled = [None if g is None else scale_in_float32_(g, grad_output) for g in (grad_hidden, grad_weight,
                                                                                        grad_bias)]
        return (*scaled, None, None, None, None, None, None)


def scale_in_float32_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad *= scale`` in place, the product taken in float32 and rounded to ``grad``'s dtype once.

    Eager backward multiplies the loss's upstream gradient into the float32 logits gradient before anything is
    rounded. Rounding ``scale`` to bfloat16 first (1/3 from gradient accumulation, 1/num_items, a loss scale) would
    move every gradient of the model by the same relative error, up to 2**-8: a bias, where rounding each product
    once is not. Half-precision gradients go through float32 in blocks of :data:`_SCALE_BLOCK` elements, so the
    scratch stays small beside a ``[V, H]`` weight gradient.

    Example:
        >>> g = torch.full((2,), 3.0, dtype=torch.bfloat16)
        >>> scale_in_float32_(g, torch.tensor(0.5)).tolist()
        [1.5, 1.5]
    """
    scale = scale.to(device=grad.device, dtype=torch.float32)
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(scale.to(grad.dtype))
    flat = grad.view(-1)  # the stored gradients are contiguous (empty_like / a dtype cast of a fresh tensor)
    for block in flat.split(_SCALE_BLOCK):
        block.copy_(block.float().mul_(scale))
    return grad


def fused_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(lm_head(hidden_states), ...)`` on already-shifted labels, chunked.

    Follows the ``causal_lm_loss`` calling convention: logits are computed in the weight's dtype and upcast
    to float32; rows labelled ``ignore_index`` contribute nothing; the sum is divided by
    ``num_items_in_batch`` when given, else averaged over non-ignored rows; ``softcap`` applies
    ``softcap * tanh(logits / softcap)`` (in float32, where eager Gemma-2 rounds the capped logits to the
    model dtype first).

    Example:
        >>> import torch
        >>> hidden, weight = torch.randn(6, 4), torch.randn(16, 4)
        >>> labels = torch.tensor([3, 1, -100, 0, 15, 2])
        >>> loss = fused_linear_cross_entropy(hidden, weight, labels, num_items_in_batch=5)
        >>> reference = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum") / 5
        >>> bool(torch.allclose(loss, reference))
        True

    Args:
        hidden_states: ``[N, H]`` final hidden states (after the last norm).
        weight: ``[V, H]`` LM-head weight (the embedding matrix when tied).
        labels: ``[N]`` integer targets, already shifted.
        bias: optional ``[V]`` LM-head bias.
        ignore_index: label value whose rows are skipped.
        num_items_in_batch: divisor for the summed loss (gradient accumulation); ``None`` means mean.
        softcap: final-logit soft-capping value, or ``None``.
        logit_scale: a factor the logits are multiplied by (in their own dtype, as eager does, then upcast; before
            any soft-capping), or ``None``: Granite's ``1 / logits_scaling``, Command-R's ``logit_scale``.
        chunk_size: tokens per chunk; ``None`` derives it from ``memory_budget`` and the vocabulary size.
        memory_budget: bytes of logit work space per chunk (see :data:`DEFAULT_MEMORY_BUDGET`).

    Returns:
        A float32 0-d loss tensor.
    """
    if hidden_states.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "fused_linear_cross_entropy expects hidden_states [N, H], weight [V, H] and labels [N]; got "
            f"{tuple(hidden_states.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if hidden_states.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden_states.shape[0]} hidden rows but {labels.shape[0]} labels")
    rows = chunk_size or chunk_rows(hidden_states.shape[0], weight.shape[0], memory_budget=memory_budget)
    return _FusedLinearCrossEntropy.apply(
        hidden_states.contiguous(), weight, bias, labels, ignore_index, num_items_in_batch, softcap, max(rows, 1),
        logit_scale,
    )
