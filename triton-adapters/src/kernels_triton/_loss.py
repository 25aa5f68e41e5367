"""Causal-LM loss as a fused linear cross-entropy: one Triton kernel per chunk of tokens, as a ``torch.library``
custom op.

The ``[N, V]`` logits are never materialised at once: the forward walks the tokens in chunks, computes a chunk's
logits with one GEMM, turns them in place into the loss rows and the logits' gradient with one kernel launch, and
produces the gradients of the hidden states, the head weight and bias right away, so backward only scales them.
The mean's divisor (the count of labelled tokens, or ``num_items_in_batch``) stays on the device and the kernel
reads it there: unlike Liger's loss, which reads the count on the host (``.item()``), nothing here waits for the
GPU. As a custom op with a fake (meta) implementation and an autograd formula, it compiles with ``fullgraph=True``
and Inductor never autotunes or fuses into it.
"""

# Triton kernel parameters are pointers and scalars whose types the JIT specialises at launch; they take no hints.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._compile import tracing
from ._custom_op import custom_op
from ._gated import _tanh
from ._launch import next_power_of_2


__all__ = ["fused_linear_cross_entropy"]

_EMPTY = (0,)

# Every chunk reads and writes the whole [V, H] weight gradient once (a GEMM with K = rows), so thin chunks make the
# loss memory-bound: on the H100 at 256-row chunks the Gemma-3-4B shape's loss took 82 ms of a 165 ms step against
# 48 ms for torch.compile's unchunked loss. 2048 rows make those GEMMs compute-bound in every published shape, for
# one chunk of logits (2048 x V, 1.0 GiB at Gemma's 262k vocabulary) on top of the [V, H] gradient already held.
_CHUNK_ROWS = 2048
# Columns per block of the row loop; one program per row, as wide as Triton's register budget allows.
_MAX_BLOCK = 32768


@triton.jit
def _capped(x, softcap, SOFTCAP: tl.constexpr):
    # Returns the (capped) logits and d capped / d logits.
    if SOFTCAP:
        t = _tanh(x / softcap)
        return softcap * t, 1.0 - t * t
    return x, tl.full(x.shape, 1.0, tl.float32)  # a tensor in both branches: Triton unifies the return types


@triton.jit(do_not_specialize=["ignore_index", "softcap"])
def _cross_entropy_kernel(LOGITS, stride, LABELS, LOSS, SCALE, n_cols, ignore_index, softcap,
                          SOFTCAP: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # One row: its loss times SCALE into LOSS and, with GRAD, (softmax - onehot) * SCALE over its logits, in place.
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    label = tl.load(LABELS + row)
    cols = tl.arange(0, BLOCK)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        if GRAD:
            for start in range(0, n_cols, BLOCK):
                tl.store(base + start + cols, tl.zeros((BLOCK,), tl.float32).to(LOGITS.dtype.element_ty),
                         mask=start + cols < n_cols)
        return
    scale = tl.load(SCALE)
    # Online logsumexp over the row's blocks.
    row_max = -float("inf")
    row_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x, _ = _capped(tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32), softcap, SOFTCAP)
        x = tl.where(mask, x, -float("inf"))  # after capping, which would map -inf to -softcap
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    lse = row_max + tl.log(row_sum)
    target, _ = _capped(tl.load(base + label).to(tl.float32), softcap, SOFTCAP)
    tl.store(LOSS + row, (lse - target) * scale)
    if GRAD:
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x, d_cap = _capped(tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32), softcap, SOFTCAP)
            grad = (tl.exp(x - lse) - tl.where(start + cols == label, 1.0, 0.0)) * (d_cap * scale)
            tl.store(base + start + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # The GEMMs run in the dtype eager's lm_head would: autocast's where it is on (out= GEMMs bypass autocast).
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _flce_fake(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor, ignore_index: int, softcap: float, grad_hidden: bool, grad_weight: bool,
               chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        hidden_states.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden_states) if grad_hidden else hidden_states.new_empty(_EMPTY),
        torch.empty_like(weight) if grad_weight else hidden_states.new_empty(_EMPTY),
        torch.empty_like(bias) if (grad_weight and bias is not None) else hidden_states.new_empty(_EMPTY),
    )


@custom_op("fused_linear_cross_entropy", fake=_flce_fake)
def _flce(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
          scale: torch.Tensor, ignore_index: int, softcap: float, grad_hidden: bool, grad_weight: bool,
          chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss ``sum(row losses) * scale`` and its gradients (for an upstream gradient of 1), or empty tensors for the
    gradients not asked for."""
    tokens, vocab = hidden_states.shape[0], weight.shape[0]
    dtype = _matmul_dtype(hidden_states, weight)
    hidden, head = hidden_states.contiguous().to(dtype), weight.contiguous().to(dtype)
    head_bias = None if bias is None else bias.to(dtype)
    labels = labels.contiguous()
    scale = scale.to(torch.float32).reshape(1)
    loss_rows = hidden.new_empty(tokens, dtype=torch.float32)
    want_grad = grad_hidden or grad_weight
    g_hidden = hidden.new_empty(hidden.shape) if grad_hidden else None
    g_weight = head.new_empty(head.shape) if grad_weight else None
    g_bias = hidden.new_zeros(vocab, dtype=torch.float32) if (grad_weight and bias is not None) else None
    rows = max(1, min(tokens, chunk_rows))
    logits_buffer = hidden.new_empty((rows, vocab))
    block = min(_MAX_BLOCK, next_power_of_2(vocab))
    for start in range(0, tokens, rows):
        stop = min(start + rows, tokens)
        chunk, logits = hidden[start:stop], logits_buffer[: stop - start]
        if head_bias is None:
            torch.mm(chunk, head.t(), out=logits)
        else:
            torch.addmm(head_bias, chunk, head.t(), out=logits)
        _cross_entropy_kernel[(stop - start,)](
            logits, logits.stride(0), labels[start:stop], loss_rows[start:stop], scale, vocab, ignore_index,
            softcap, SOFTCAP=softcap > 0.0, GRAD=want_grad, BLOCK=block,
            num_warps=16 if torch.version.hip else 32,  # AMD's 64-wide wavefronts: 16 warps fill a workgroup
        )
        if g_hidden is not None:
            torch.mm(logits, head, out=g_hidden[start:stop])
        if g_weight is not None:
            # The first chunk writes the gradient, later ones accumulate: no zero-fill of the [V, H] tensor.
            if start == 0:
                torch.mm(logits.t(), chunk, out=g_weight)
            else:
                g_weight.addmm_(logits.t(), chunk)
            if g_bias is not None:
                g_bias.add_(logits.sum(0, dtype=torch.float32))
    # Custom-op outputs may not alias each other: one fresh empty tensor per unused slot.
    return (
        loss_rows.sum(),
        g_hidden.to(hidden_states.dtype) if g_hidden is not None else hidden_states.new_empty(_EMPTY),
        g_weight.to(weight.dtype) if g_weight is not None else hidden_states.new_empty(_EMPTY),
        g_bias.to(bias.dtype) if g_bias is not None else hidden_states.new_empty(_EMPTY),  # type: ignore[union-attr]
    )


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    _, g_hidden, g_weight, g_bias = output
    hidden_states, weight, _, bias, _, _, _, grad_hidden, grad_weight, _ = inputs
    ctx.flags = (grad_hidden, grad_weight, bias is not None and grad_weight)  # type: ignore[attr-defined]
    ctx.save_for_backward(g_hidden, g_weight, g_bias)  # type: ignore[attr-defined]
    # The stored gradients are outputs only to carry them to backward; nothing differentiates through them.
    # Without this, autograd would hand backward zero-filled gradients for them: one more [V, H] tensor at the
    # start of backward, the moment of peak memory (measured: +0.3 GiB for Qwen3-0.6B's tied head).
    ctx.mark_non_differentiable(g_hidden, g_weight, g_bias)  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # type: ignore[attr-defined]


def _scale(grad: torch.Tensor, grad_loss: torch.Tensor, *, in_place: bool) -> torch.Tensor:
    scale = grad_loss.to(grad.dtype)
    return grad.mul_(scale) if in_place else grad * scale


def _backward(ctx: object, grad_loss: torch.Tensor, *_: torch.Tensor) -> tuple:
    g_hidden, g_weight, g_bias = ctx.saved_tensors  # type: ignore[attr-defined]
    want_hidden, want_weight, want_bias = ctx.flags  # type: ignore[attr-defined]
    # Scaling the stored gradients in place avoids a second [V, H] tensor at the moment of peak memory; they belong
    # to this node alone. The in-place write bumps their version, so a second backward through the same graph
    # (retain_graph=True) raises autograd's "modified by an inplace operation" error instead of scaling twice.
    # Traced backward graphs are functional, so there a copy is scaled.
    in_place = not tracing()
    return (
        _scale(g_hidden, grad_loss, in_place=in_place) if want_hidden else None,
        _scale(g_weight, grad_loss, in_place=in_place) if want_weight else None,
        None,
        _scale(g_bias, grad_loss, in_place=in_place) if want_bias else None,
        *(None,) * 6,  # the divisor and the non-tensor inputs
    )


_flce.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    ignore_index: int,
    num_items_in_batch: int | torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden_states @ weight.T (+ bias)`` against already-shifted ``labels``, in float32.

    The summed row losses are divided by ``num_items_in_batch`` when given, else by the count of rows not labelled
    ``ignore_index`` (zero when there are none). Each row's loss and gradient are scaled by that divisor's
    reciprocal inside the kernel, in float32, before the gradient is rounded to the GEMMs' dtype.

    Example:
        >>> import torch
        >>> h, w = torch.randn(6, 8, device="cuda"), torch.randn(32, 8, device="cuda")  # doctest: +SKIP
        >>> fused_linear_cross_entropy(h, w, torch.randint(0, 32, (6,), device="cuda"), bias=None,
        ...                            ignore_index=-100, num_items_in_batch=None, softcap=None)  # doctest: +SKIP
        tensor(..., device='cuda:0')
    """
    if not hidden_states.is_cuda:
        # The Triton kernel is compiled for GPUs; elsewhere the core's chunked loss computes the same thing.
        from kernels_core.portable import fused_linear_cross_entropy as portable

        return portable(hidden_states, weight, labels, bias=bias, ignore_index=ignore_index,
                        num_items_in_batch=num_items_in_batch, softcap=softcap)
    grad_on = torch.is_grad_enabled()
    grad_hidden = grad_on and hidden_states.requires_grad
    grad_weight = grad_on and (weight.requires_grad or (bias is not None and bias.requires_grad))
    loss, _, _, _ = _flce(
        hidden_states, weight, labels, bias, loss_scale(labels, ignore_index, num_items_in_batch),
        int(ignore_index), float(softcap or 0.0), grad_hidden, grad_weight, _CHUNK_ROWS,
    )
    return loss


def loss_scale(labels: torch.Tensor, ignore_index: int, num_items_in_batch: int | torch.Tensor | None,
               ) -> torch.Tensor:
    """The reciprocal of the loss's divisor as a float32 device scalar, computed without reading the device.

    Example:
        >>> loss_scale(torch.tensor([3, -100, 5, 1]), -100, None)
        tensor(0.3333)
        >>> loss_scale(torch.tensor([3, -100]), -100, 8)
        tensor(0.1250)
    """
    if num_items_in_batch is None:
        count = (labels != ignore_index).sum()
    elif isinstance(num_items_in_batch, torch.Tensor):
        count = num_items_in_batch.to(labels.device)
    else:
        # A fill rather than a copy from host memory: no transfer for the device's queue to wait on.
        count = torch.full((), float(num_items_in_batch), device=labels.device)
    return count.to(torch.float32).clamp_min(1.0).reciprocal()
