"""Causal-LM loss through Liger's fused linear cross-entropy, as a ``torch.library`` custom op.

The ``[N, V]`` logits are never materialised at once: Liger computes them chunk by chunk and produces the
gradients of the hidden states, the head weight and bias during the forward pass. Wrapping that as a custom op
with a fake (meta) implementation and an autograd formula makes it opaque to Dynamo and Inductor, so it
compiles with ``fullgraph=True`` without graph breaks and Inductor never autotunes Liger's Triton code (which
crashed with an illegal memory access when Liger's own patching was compiled).

Gradient precision as eager's: Liger accumulates the head weight's (and bias's) gradient across its token chunks in the
parameter dtype unless asked otherwise, so with more than one chunk it is asked for float32 (one rounding at the end,
as eager's single product); and the loss's upstream gradient scales the stored gradients in float32 (see
:func:`_scale`).

Liger reads the count of labelled tokens on the host (``.item()``): one host sync per training step. A kernel of
this package's own that kept the count on the device measured within noise at model level (H100, kernelized
training step; ``benchmarks/results/configs-ab-h100.json``, run ``own-loss``: Qwen3-0.6B 0.99x, Mixtral-8x7B
1.01x, Gemma-3-4B 1.01x), so Liger's kernel stays.
"""

from __future__ import annotations

import os

import torch

from ._compile import tracing
from ._custom_op import custom_op


__all__ = ["CHUNK_ROWS_ENV", "fused_linear_cross_entropy"]

_EMPTY = (0,)

# Liger sizes its token chunks so that one chunk's logits hold about chunk_mem_const x tokens x hidden elements;
# its default (1) gives 64-row chunks for a 152k vocabulary and 8192 tokens. Every chunk reads and writes the whole
# [V, H] weight gradient once (an addmm with K = rows), so thin chunks make the loss memory-bound: on the H100 at
# 256-row chunks the Gemma-3-4B shape's loss took 82 ms of a 165 ms step against 48 ms for torch.compile's
# unchunked loss. Chunks of about 2048 rows make those matmuls compute-bound in every published shape, for one
# chunk of logits (2048 x V, 1.0 GiB at Gemma's 262k vocabulary) on top of the [V, H] gradient already held.
_DEFAULT_CHUNK_ROWS = 2048
# Overrides the chunk rows for the process, read once when this module is imported (benchmarks sweep it).
CHUNK_ROWS_ENV = "KERNELS_TRITON_LOSS_CHUNK_ROWS"


def _chunk_rows_setting() -> int:
    """The token rows per chunk: :data:`CHUNK_ROWS_ENV` if set (a positive integer, else ValueError), else 2048.

    Example:
        >>> _chunk_rows_setting() == int(os.environ.get(CHUNK_ROWS_ENV) or _DEFAULT_CHUNK_ROWS)
        True
    """
    value = os.environ.get(CHUNK_ROWS_ENV, "").strip()
    if not value:
        return _DEFAULT_CHUNK_ROWS
    rows = int(value) if value.isdigit() else 0
    if rows <= 0:
        raise ValueError(f"{CHUNK_ROWS_ENV}={value!r}: expected a positive number of token rows per chunk")
    return rows


_CHUNK_ROWS = _chunk_rows_setting()


# cuBLAS takes its fast Hopper GEMMs only for 16-byte aligned rows: a vocabulary that is not a multiple of 8
# (Granite's 49155, GPT-2's 50257) leaves every [rows, V] logits chunk misaligned, and the three lm_head products
# fall back to CUTLASS's SM75 "align1" kernels. Measured on an H200, Granite-3-8B shape (2 x 4096 tokens): 83 ms of
# a 161 ms step went to those products. Such vocabularies are padded to a multiple of _VOCAB_ALIGN rows.
_VOCAB_ALIGN = 64


def _padded_vocab(weight: torch.Tensor, bias: torch.Tensor | None, softcap: float,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight`` with zero rows and ``bias`` with -inf entries up to a multiple of :data:`_VOCAB_ALIGN` rows.

    A padded logit is ``0 + (-inf)``: it adds nothing to any row's softmax and gets a zero gradient, and adding the
    real rows' zero bias changes no logit. Soft-capping would map -inf to ``-softcap``, so with a soft-cap (and for
    vocabularies already a multiple of 8) the operands are returned as they are.

    Example:
        >>> w, b = _padded_vocab(torch.ones(5, 2), None, 0.0)
        >>> tuple(w.shape), b[4].item(), b[5].item()
        ((64, 2), 0.0, -inf)
    """
    vocab = weight.shape[0]
    if vocab % 8 == 0 or softcap > 0.0:
        return weight, bias
    pad = -vocab % _VOCAB_ALIGN
    weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])
    if bias is None:
        bias = weight.new_zeros(vocab + pad)
        bias[vocab:] = float("-inf")
    else:
        bias = torch.cat([bias, bias.new_full((pad,), float("-inf"))])
    return weight, bias


# Elements per float32 scratch block when backward scales a half-precision gradient (64 MiB).
_SCALE_BLOCK = 2**24


def _chunk_mem_const(n_tokens: int, vocab: int, hidden: int) -> int:
    """Liger's ``chunk_mem_const`` for chunks of about ``_CHUNK_ROWS`` rows (one chunk when there are fewer)."""
    return max(1, -(-vocab * _CHUNK_ROWS // max(1, n_tokens * hidden)))


def _liger_chunks(n_tokens: int, vocab: int, hidden: int, chunk_mem_const: int) -> int:
    """How many token chunks Liger's fused linear cross-entropy takes (its own sizing rule, liger-kernel 0.8.5).

    Example:
        >>> _liger_chunks(8192, 151936, 1024, _chunk_mem_const(8192, 151936, 1024))
        4
        >>> _liger_chunks(100, 151936, 1024, _chunk_mem_const(100, 151936, 1024))
        1
    """
    if n_tokens <= 0:
        return 1
    inc_factor = -(-vocab // (chunk_mem_const * hidden))
    chunk = min(1 << max(0, (-(-n_tokens // inc_factor) - 1).bit_length()), n_tokens)
    return -(-n_tokens // chunk)


def _flce_fake(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
               ignore_index: int, softcap: float, reduction: str, grad_hidden: bool, grad_weight: bool,
               chunk_mem_const: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        hidden_states.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden_states) if grad_hidden else hidden_states.new_empty(_EMPTY),
        torch.empty_like(weight) if grad_weight else hidden_states.new_empty(_EMPTY),
        torch.empty_like(bias) if (grad_weight and bias is not None) else hidden_states.new_empty(_EMPTY),
    )


@custom_op("fused_linear_cross_entropy", fake=_flce_fake)
def _flce(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
          ignore_index: int, softcap: float, reduction: str, grad_hidden: bool, grad_weight: bool,
          chunk_mem_const: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    needs_grad = grad_hidden or grad_weight or (bias is not None and grad_weight)
    # Liger sums the weight and bias gradients over its token chunks in their own dtype unless given accum_dtype:
    # in half precision that rounds once per chunk where eager's single product rounds once. float32 then, cast
    # once at the end; it holds a float32 [V, H] accumulator instead of one in the weight's dtype (twice the
    # bytes, during the loss's forward). One chunk needs no accumulator of another dtype.
    low_precision = weight.dtype in (torch.float16, torch.bfloat16)
    several = _liger_chunks(hidden_states.shape[0], weight.shape[0], weight.shape[1], chunk_mem_const) > 1
    vocab, given_bias = weight.shape[0], bias
    weight, bias = _padded_vocab(weight.contiguous(), bias, softcap)
    loss, _, _, _, g_hidden, g_weight, g_bias = fused_linear_cross_entropy_forward(
        _input=hidden_states.contiguous(),
        weight=weight,
        target=labels.contiguous(),
        bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap if softcap > 0.0 else None,
        compute_gradients=needs_grad,
        weight_requires_grad=grad_weight,
        chunk_mem_const=chunk_mem_const,
        accum_dtype=torch.float32 if (grad_weight and low_precision and several) else None,
    )
    if weight.shape[0] != vocab:  # the padded rows' gradients are zero; the bias's is wanted only if one was given
        g_weight = None if g_weight is None else g_weight[:vocab]
        g_bias = None if (g_bias is None or given_bias is None) else g_bias[:vocab]
    # Custom-op outputs may not alias each other: one fresh empty tensor per unused slot.
    return (
        loss.float().reshape(()).clone(),
        g_hidden if (grad_hidden and g_hidden is not None) else hidden_states.new_empty(_EMPTY),
        g_weight if (grad_weight and g_weight is not None) else hidden_states.new_empty(_EMPTY),
        g_bias if (grad_weight and g_bias is not None) else hidden_states.new_empty(_EMPTY),
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
    """``grad * grad_loss``, the product in float32 and rounded to ``grad``'s dtype once.

    Eager backward multiplies the upstream gradient into the float32 logits gradient before anything is rounded.
    Rounding ``grad_loss`` to bfloat16 first (it is ``1 / num_items_in_batch`` here whenever that is given) would
    scale every gradient of the model by the same wrong factor, off by up to 2**-8. In place (eagerly), half-precision
    gradients go through float32 in blocks of :data:`_SCALE_BLOCK` elements, so the scratch stays small beside a
    ``[V, H]`` weight gradient; traced, Inductor fuses the casts into one pass.

    Example:
        >>> _scale(torch.full((2,), 3.0, dtype=torch.bfloat16), torch.tensor(0.5), in_place=False).tolist()
        [1.5, 1.5]
    """
    scale = grad_loss.to(device=grad.device, dtype=torch.float32)
    if grad.dtype in (torch.float32, torch.float64):
        scale = scale.to(grad.dtype)
        return grad.mul_(scale) if in_place else grad * scale
    if not in_place:
        return (grad.float() * scale).to(grad.dtype)
    for block in grad.view(-1).split(_SCALE_BLOCK):  # Liger's gradients are fresh contiguous tensors
        block.copy_(block.float().mul_(scale))
    return grad


def _backward(ctx: object, grad_loss: torch.Tensor, *_: torch.Tensor) -> tuple:
    g_hidden, g_weight, g_bias = ctx.saved_tensors  # type: ignore[attr-defined]
    want_hidden, want_weight, want_bias = ctx.flags  # type: ignore[attr-defined]
    # Scaling the stored gradients in place (as Liger does) avoids a second [V, H] tensor at the moment of peak
    # memory; they belong to this node alone. The in-place write bumps their version, so a second backward through
    # the same graph (retain_graph=True) raises autograd's "modified by an inplace operation" error instead of
    # scaling twice. Traced backward graphs are functional, so there a copy is scaled.
    in_place = not tracing()
    return (
        _scale(g_hidden, grad_loss, in_place=in_place) if want_hidden else None,
        _scale(g_weight, grad_loss, in_place=in_place) if want_weight else None,
        None,
        _scale(g_bias, grad_loss, in_place=in_place) if want_bias else None,
        *(None,) * 6,  # the non-tensor inputs
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
    logit_scale: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden_states @ weight.T (+ bias)`` against already-shifted ``labels``, in float32.

    ``logit_scale`` multiplies the logits before any soft-capping (Granite, Command-R). Liger's kernel takes no
    scale, so the hidden rows (and the bias) are scaled instead, ``(s h) W^T + s b``, each rounded once in their
    dtype. That is eager's result exactly when the scale is a power of two (Granite's 1/8 and 1/16, Command-R's
    1/16) or the dtype float32 (up to float32 rounding); otherwise, in half precision, each logit is within
    ``u * (sum_k |s h_k W_jk| + 3 |s z_j|)`` of eager's, which rounds ``z`` and then ``s z`` (``u`` the dtype's unit
    roundoff, 2**-8 in bfloat16), and each row's loss within twice the largest of those
    (``core/docs/kernel-conventions.md``; ``tests/test_loss.py`` checks it). The core's portable loss, on CPU
    tensors, scales the logits in their dtype as eager does.

    Without ``num_items_in_batch`` Liger's ``mean`` reduction divides by the non-ignored rows inside the kernel,
    in float32. With it, Liger sums and the division happens here; its gradient then scales Liger's stored
    gradients in float32 (one rounding per element, as eager's). Liger takes the tokens in chunks of about 2048
    rows (``KERNELS_TRITON_LOSS_CHUNK_ROWS``, read once at import, overrides it).

    Example:
        >>> import torch
        >>> h, w, labels = torch.randn(6, 8), torch.randn(32, 8), torch.randint(0, 32, (6,))
        >>> loss = fused_linear_cross_entropy(h, w, labels, bias=None, ignore_index=-100, num_items_in_batch=None,
        ...                                   softcap=None)   # CPU tensors: the core's portable loss
        >>> loss.dtype, loss.shape
        (torch.float32, torch.Size([]))
        >>> h, w = torch.randn(6, 8, device="cuda"), torch.randn(32, 8, device="cuda")  # doctest: +SKIP
        >>> fused_linear_cross_entropy(h, w, torch.randint(0, 32, (6,), device="cuda"), bias=None,
        ...                            ignore_index=-100, num_items_in_batch=None, softcap=None)  # doctest: +SKIP
        tensor(..., device='cuda:0')
    """
    if not hidden_states.is_cuda:
        # Liger's Triton kernel needs a GPU; elsewhere the core's chunked loss computes the same thing.
        from kernels_core.portable import fused_linear_cross_entropy as portable

        return portable(hidden_states, weight, labels, bias=bias, ignore_index=ignore_index,
                        num_items_in_batch=num_items_in_batch, softcap=softcap, logit_scale=logit_scale)
    return _liger_loss(hidden_states, weight, labels, bias=bias, ignore_index=ignore_index,
                       num_items_in_batch=num_items_in_batch, softcap=softcap, logit_scale=logit_scale)


def _liger_loss(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                bias: torch.Tensor | None, ignore_index: int, num_items_in_batch: int | torch.Tensor | None,
                softcap: float | None, logit_scale: float | None = None) -> torch.Tensor:
    # fused_linear_cross_entropy through the custom op on any device (CPU tensors: Triton's interpreter, in tests).
    if logit_scale is not None:
        # s * (h W^T + b) = (s h) W^T + s b: autograd carries s into both gradients.
        hidden_states = hidden_states * logit_scale
        bias = None if bias is None else bias * logit_scale
    grad_on = torch.is_grad_enabled()
    grad_hidden = grad_on and hidden_states.requires_grad
    grad_weight = grad_on and (weight.requires_grad or (bias is not None and bias.requires_grad))
    reduction = "mean" if num_items_in_batch is None else "sum"
    chunk_mem_const = _chunk_mem_const(hidden_states.shape[0], weight.shape[0], weight.shape[1])
    loss, _, _, _ = _flce(
        hidden_states, weight, labels, bias, int(ignore_index), float(softcap or 0.0), reduction, grad_hidden,
        grad_weight, chunk_mem_const,
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        return loss / num_items_in_batch.to(device=loss.device, dtype=torch.float32)
    return loss / float(num_items_in_batch)
