"""The chunked fused linear cross-entropy against transformers' own ``ForCausalLMLoss``, forward and backward.

The reference is exactly what an eager ``*ForCausalLM`` computes in training: ``lm_head(hidden)`` in the model
dtype, then ``ForCausalLMLoss`` (float32 upcast, label padding and shifting, sum / num_items_in_batch or
mean). The kernel receives what the core's adapter hands it: flattened hidden states and shifted labels.
"""

from __future__ import annotations

import pytest
import torch
from kernels_core._portable._cross_entropy import chunk_rows
from kernels_core._portable._cross_entropy import fused_linear_cross_entropy
from torch.nn import functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss


IGNORE = -100
# Relative to the largest reference magnitude. float32: only summation order differs (chunked sums, fp32
# accumulation of the weight gradient), a few ulps. bfloat16/float16: logits and the gradient GEMM inputs are
# rounded exactly as in eager, but eager rounds the weight gradient once over all tokens while we round each
# chunk's product before the float32 sum, and GEMM blocking differs: allow ~2 ulps of an 8-bit (bf16) or
# 11-bit (fp16) mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def shift(labels: torch.Tensor) -> torch.Tensor:
    """What the core's adapter does: transformers' pad-and-shift, flattened."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)


def make_labels(batch: int, seq: int, vocab: int, *, generator: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[0, :5] = IGNORE  # a masked prompt
    labels[-1, -3:] = IGNORE  # right padding
    return labels


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == expected.dtype, what
    scale = expected.abs().max().float().clamp_min(1e-30)
    error = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.3g} > {TOLERANCE[dtype]:.3g}"


def reference(hidden, weight, labels, *, bias=None, num_items_in_batch=None, softcap=None, logit_scale=None):
    logits = F.linear(hidden, weight, bias)
    if logit_scale is not None:  # as Command-R / Granite do: in the model dtype, before the loss upcasts
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits.float() / softcap) * softcap
    return ForCausalLMLoss(logits, labels, weight.shape[0], num_items_in_batch=num_items_in_batch)


def run_both(
    dtype,
    *,
    batch=3,
    seq=23,
    hidden_size=24,
    vocab=97,
    chunk_size=16,
    num_items=None,
    softcap=None,
    logit_scale=None,
    with_bias=False,
    seed=0,
):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=generator).to(dtype).requires_grad_() if with_bias else None
    labels = make_labels(batch, seq, vocab, generator=generator)
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    expected = reference(hidden, weight, labels, bias=bias, num_items_in_batch=num_items, softcap=softcap,
                         logit_scale=logit_scale)
    expected_grads = torch.autograd.grad(expected, leaves)
    actual = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden_size),
        weight,
        shift(labels),
        bias=bias,
        ignore_index=IGNORE,
        num_items_in_batch=num_items,
        softcap=softcap,
        logit_scale=logit_scale,
        chunk_size=chunk_size,
    )
    actual_grads = torch.autograd.grad(actual, leaves)
    return expected, actual, expected_grads, actual_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_items", [None, 41, "tensor"])
def test_matches_transformers_loss_and_grads(dtype, num_items):
    if num_items == "tensor":
        num_items = torch.tensor(41)  # the Trainer passes a 0-d int tensor
    # 3 x 23 = 69 tokens, chunks of 16: the last chunk is partial.
    expected, actual, expected_grads, actual_grads = run_both(dtype, num_items=num_items)
    assert actual.dtype == torch.float32 and actual.dim() == 0
    # The loss itself is float32 in both, from identically rounded logits: only summation order differs.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    for name, a, e in zip(("hidden", "weight"), actual_grads, expected_grads, strict=True):
        assert_close(a, e, dtype, f"grad {name}")


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 69, 1000])
def test_chunk_size_does_not_change_the_result(chunk_size):
    expected, actual, expected_grads, actual_grads = run_both(torch.float32, chunk_size=chunk_size)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert_close(a, e, torch.float32, f"chunk {chunk_size}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(dtype):
    # Eager Gemma-2 rounds capped logits to the model dtype; the kernel caps in float32, as the convention
    # says. Comparing against a float32-capping reference isolates the kernel's own error.
    expected, actual, expected_grads, actual_grads = run_both(dtype, softcap=3.0, num_items=50)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert_close(a, e, dtype, "softcap")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("logit_scale", "softcap"), [(0.125, None), (0.3, None), (4.0, 3.0)])
def test_logit_scale(dtype, logit_scale, softcap):
    # Granite's divisor and Command-R's multiplier, before any soft-cap, with a bias: scaled in the model dtype as
    # eager does, so the loss is float32 sums of identically rounded logits, as in the unscaled case (0.3 is not a
    # power of two: in bfloat16 the product rounds, the same way in both).
    expected, actual, expected_grads, actual_grads = run_both(dtype, logit_scale=logit_scale, softcap=softcap,
                                                              with_bias=True, num_items=50)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    unscaled = run_both(dtype, softcap=softcap, with_bias=True, num_items=50)[1]
    assert not torch.allclose(actual, unscaled), "the scale must change the loss"
    for name, a, e in zip(("hidden", "weight", "bias"), actual_grads, expected_grads, strict=True):
        assert_close(a, e, dtype, f"scaled grad {name}")


def test_scaled_logits_get_eagers_rounding_not_a_float32_product():
    """With a scale that is not a power of two, bfloat16 logits scaled in float32 after the upcast are other numbers
    than eager's (scaled, then upcast): the kernel must give eager's loss, not the float32 one."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(64, 32, generator=generator).bfloat16()
    weight = torch.randn(512, 32, generator=generator).bfloat16()
    labels = torch.randint(0, 512, (64,), generator=generator)
    eager = F.cross_entropy((F.linear(hidden, weight) * 0.3).float(), labels)
    in_float32 = F.cross_entropy(F.linear(hidden, weight).float() * 0.3, labels)
    actual = fused_linear_cross_entropy(hidden, weight, labels, logit_scale=0.3, chunk_size=16)
    assert abs(actual - eager) < abs(in_float32 - eager) / 10, (actual, eager, in_float32)


def test_bias():
    expected, actual, expected_grads, actual_grads = run_both(torch.float32, with_bias=True)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    for name, a, e in zip(("hidden", "weight", "bias"), actual_grads, expected_grads, strict=True):
        assert_close(a, e, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embedding_gets_both_gradients(dtype):
    """A tied head: the weight is also the input embedding, so its gradient has two contributions."""
    generator = torch.Generator().manual_seed(1)
    vocab, size, batch, seq = 61, 16, 2, 19
    embedding = torch.nn.Embedding(vocab, size).to(dtype)
    torch.nn.init.normal_(embedding.weight, std=0.3, generator=generator)
    mix = torch.nn.Linear(size, size, bias=False).to(dtype)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = ids.clone()
    labels[1, :4] = IGNORE

    def loss_of(fused: bool) -> torch.Tensor:
        hidden = torch.tanh(mix(embedding(ids)))
        if fused:
            return fused_linear_cross_entropy(
                hidden.reshape(-1, size), embedding.weight, shift(labels), ignore_index=IGNORE, chunk_size=8
            )
        return reference(hidden, embedding.weight, labels)

    params = [embedding.weight, mix.weight]
    expected = loss_of(False)
    expected_grads = torch.autograd.grad(expected, params)
    actual = loss_of(True)
    actual_grads = torch.autograd.grad(actual, params)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    for name, a, e in zip(("embedding", "mix"), actual_grads, expected_grads, strict=True):
        assert_close(a, e, dtype, name)


def test_grad_output_is_applied():
    """Gradient accumulation scales the loss; the stored gradients must follow."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 8, generator=generator, requires_grad=True)
    weight = torch.randn(12, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 12, (10,), generator=generator)
    plain = torch.autograd.grad(fused_linear_cross_entropy(hidden, weight, labels), (hidden, weight))
    scaled = torch.autograd.grad(0.25 * fused_linear_cross_entropy(hidden, weight, labels), (hidden, weight))
    for p, s in zip(plain, scaled, strict=True):
        torch.testing.assert_close(s, 0.25 * p)


def test_all_rows_ignored_matches_eager():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    labels = torch.full((6,), IGNORE)
    expected = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    actual = fused_linear_cross_entropy(hidden, weight, labels)
    actual_grads = torch.autograd.grad(actual, (hidden, weight))
    assert torch.isnan(expected) and torch.isnan(actual)  # mean over zero rows, as in eager
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert torch.equal(a, e)  # both exactly zero, not nan


def test_frozen_head_and_no_grad():
    hidden = torch.randn(9, 4, requires_grad=True)
    weight = torch.randn(7, 4)  # frozen: no weight gradient is computed or stored
    labels = torch.randint(0, 7, (9,))
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    (grad,) = torch.autograd.grad(loss, hidden)
    expected = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, labels), hidden)[0]
    assert_close(grad, expected, torch.float32, "frozen head")
    with torch.no_grad():
        evaluation = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert not evaluation.requires_grad
    torch.testing.assert_close(evaluation, loss.detach())


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_full_logits():
    tokens, size, vocab, chunk = 64, 8, 500, 16
    hidden = torch.randn(tokens, size, requires_grad=True)
    weight = torch.randn(vocab, size, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as probe:
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    # The largest tensors are one chunk of logits and the weight gradient, both far below tokens x vocab.
    assert probe.largest == max(chunk * vocab, vocab * size)
    assert probe.largest < tokens * vocab // 2


def test_chunk_rows_follows_the_budget():
    # 256 MiB at 12 bytes per logit for a 151,936-token vocabulary, rounded down to a multiple of 16.
    assert chunk_rows(8192, 151936) == 144
    assert chunk_rows(8192, 151936, memory_budget=4 * 2**30) == 2352
    assert chunk_rows(5, 151936) == 5  # never more rows than tokens
    assert chunk_rows(8192, 10**9) == 16  # a floor, so huge vocabularies still make progress


def test_rejects_unflattened_inputs():
    with pytest.raises(ValueError, match="expects hidden_states"):
        fused_linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(6, dtype=torch.long))


def test_second_backward_is_refused_not_double_scaled():
    # Backward scales the stored gradients in place; autograd's saved-tensor version check must catch reuse.
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.randint(0, 6, (5,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_under_autocast_matches_eager_autocast():
    """Mixed precision (float32 weights, bfloat16 autocast): logits and gradient GEMMs run in bfloat16 in both."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 16, generator=generator, requires_grad=True)
    weight = (torch.randn(50, 16, generator=generator) * 0.3).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ForCausalLMLoss(F.linear(hidden, weight), labels, 50)
        actual = fused_linear_cross_entropy(hidden.reshape(-1, 16), weight, shift(labels), chunk_size=4)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    actual_grads = torch.autograd.grad(actual, (hidden, weight))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=0)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert_close(a, e, torch.bfloat16, "autocast")  # float32 grads, but bfloat16 GEMMs on both sides


def _scale_error(grad: torch.Tensor, truth: torch.Tensor) -> float:
    """How far the least-squares factor between ``grad`` and ``truth`` is from 1: a rescaling of the whole gradient,
    which rounding noise (of either sign, element by element) hardly moves."""
    grad, truth = grad.double(), truth.double()
    return abs((grad * truth).sum().item() / (truth * truth).sum().item() - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("upstream", [1 / 3, 1 / 7], ids=["times_1_3", "times_1_7"])
def test_upstream_gradient_scales_the_stored_gradients_in_float32(dtype, upstream):
    """Gradient accumulation multiplies the loss by 1/steps: that upstream gradient must scale the gradients stored
    in the forward in float32, as eager's backward does. Rounded to the model dtype first, it rescales every gradient
    of the model by ``delta`` (0.20% in bfloat16 for 1/3 and 1/7). Element-wise both round, so the bound is on the
    least-squares factor against float64: within ``delta / 2`` of eager's (ours rounds twice, stored then scaled,
    which moved it by at most a third of ``delta`` in these runs)."""
    delta = abs(torch.tensor(upstream).to(dtype).double().item() / upstream - 1)
    assert delta > 2**-13, "the upstream gradient must be one the dtype rounds noticeably"
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(256, 64, generator=generator).to(dtype)
    weight = (torch.randn(97, 64, generator=generator) / 8).to(dtype)
    labels = torch.randint(0, 97, (256,), generator=generator)
    labels[:7] = IGNORE

    def grads(loss_fn, cast: torch.dtype) -> tuple[torch.Tensor, ...]:
        leaves = [hidden.to(cast).requires_grad_(), weight.to(cast).requires_grad_()]
        return torch.autograd.grad(loss_fn(*leaves) * upstream, leaves)

    def eager(h, w):
        return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=IGNORE)

    def ours(h, w):
        return fused_linear_cross_entropy(h, w, labels, ignore_index=IGNORE, chunk_size=64)

    truth, expected, actual = grads(eager, torch.float64), grads(eager, dtype), grads(ours, dtype)
    for name, a, e, t in zip(("hidden", "weight"), actual, expected, truth, strict=True):
        ours_off, eager_off = _scale_error(a, t), _scale_error(e, t)
        assert ours_off <= eager_off + delta / 2, \
            f"{name}: gradient rescaled by {ours_off:.2e} (eager {eager_off:.2e}; scale rounding {delta:.2e})"
