"""The fused linear cross-entropy custom op (Liger's kernel) against ``F.cross_entropy`` over eager's logits.

On a GPU Liger's kernel runs compiled; without one, in Triton's interpreter on CPU tensors. The adapter routes CPU
tensors to the core's portable loss, so these tests call the custom op itself, as the adapter does: forward and
backward, in the three dtypes, with and without softcapping, bias, ignored rows and ``num_items_in_batch``, in one
chunk or many, and this package's autograd formula around Liger's stored gradients (upstream-gradient scaling, the
in-place scaling guard). ``test_liger_gpu.py`` checks the adapter itself on a GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES
from conftest import FLOOR
from conftest import assert_as_good_as_eager
from conftest import rel_err
from conftest import run_with_grads


pytest.importorskip("liger_kernel", reason="needs liger-kernel (a dependency of kernels-cuda)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

N, H, V = 37, 16, 101  # odd sizes: a partial column block and a partial last chunk
# The adapter's target chunk rows: 8 makes Liger take three chunks of 16 rows here, the default one chunk of all 37.
MANY_CHUNKS, ONE_CHUNK = 8, 2048


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    tensors = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3, torch.randn(V, generator=g), labels
    return tuple(t.to(DEV) for t in tensors)


def _eager(labels, *, num_items=None, softcap=None, logit_scale=None):
    def loss(x, w, b=None):
        logits = F.linear(x, w, b)
        if logit_scale is not None:  # as Granite / Command-R do: in the model's dtype, then the loss upcasts
            logits = logits * logit_scale
        logits = logits.float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        total = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum" if num_items else "mean")
        return total / num_items if num_items else total
    return loss


def _ours(labels, *, num_items=None, softcap=None, logit_scale=None, chunk_rows=MANY_CHUNKS):
    from kernels_triton import _loss

    def loss(x, w, b=None):
        # The adapter past its CPU routing: the same custom op call and division as on a GPU.
        with mock.patch.object(_loss, "_CHUNK_ROWS", chunk_rows):
            return _loss._liger_loss(x, w, labels, bias=b, ignore_index=-100, num_items_in_batch=num_items,
                                     softcap=softcap, logit_scale=logit_scale)
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# scaled: Granite's 1/8 (a power of two: exact) with a bias; scaled_odd: 0.3, which the scaled hidden rows round.
@pytest.mark.parametrize("case", ["mean", "num_items", "bias", "scaled", "scaled_odd", pytest.param(
    "softcap", marks=pytest.mark.skipif(
    DEV == "cpu", reason="Liger's softcapping calls libdevice's tanh, which Triton's interpreter cannot run; GPUs "
                         "run it here and in test_liger_gpu.py"))])
@pytest.mark.parametrize("chunk_rows", [MANY_CHUNKS, ONE_CHUNK], ids=["chunks", "one_chunk"])
def test_loss_and_gradients_match_eager(case, chunk_rows, dtype):
    x, w, b, labels = _inputs()
    options = {"num_items": 53 if case == "num_items" else None, "softcap": 2.0 if case == "softcap" else None,
               "logit_scale": {"scaled": 0.125, "scaled_odd": 0.3}.get(case)}
    ours, eager = _ours(labels, chunk_rows=chunk_rows, **options), _eager(labels, **options)
    params = [w, b] if case in ("bias", "scaled") else [w]
    one = [torch.tensor(1.0, device=DEV)]
    (lo,), g_ours = run_with_grads(ours, [x.to(dtype)], [p.to(dtype) for p in params], one)
    (le,), g_eager = run_with_grads(eager, [x.to(dtype)], [p.to(dtype) for p in params], one)
    (lt,), g_truth = run_with_grads(eager, [x.double()], [p.double() for p in params], one)
    assert lo.dtype == torch.float32 and lo.dim() == 0
    # Both losses are float32 sums of float32 rows; the logits' rounding to dtype is the error that remains.
    assert abs(lo.item() - lt.item()) <= 2 * abs(le.item() - lt.item()) + FLOOR[dtype] * abs(lt.item())
    for i, (go, ge, gt) in enumerate(zip(g_ours, g_eager, g_truth, strict=True)):
        assert_as_good_as_eager(go, ge, gt, dtype, f"{case} grad {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("logit_scale", [0.3, 1 / 6, 0.8333333])  # not powers of two (Granite-MoE 1/6, Command R+)
def test_scaled_loss_is_within_the_stated_bound_of_eager(dtype, logit_scale):
    """The bound core/docs/kernel-conventions.md states for a scale that is not a power of two in half precision:
    Liger scales the hidden rows before its GEMM where eager scales the rounded logits, so each logit is within
    u * (sum_k |s h_k W_jk| + 3 |s z_j|) of eager's (one rounding of every scaled hidden value, eager's two of the
    logit), and each row's loss, lse(z) - z_target, within twice the largest of those (u the dtype's unit
    roundoff)."""
    x, w, _, labels = _inputs(7)
    x, w = x.to(dtype), w.to(dtype)
    ours = _ours(labels, logit_scale=logit_scale)(x, w).item()
    eager = _eager(labels, logit_scale=logit_scale)(x, w).item()
    u = torch.finfo(dtype).eps / 2
    h, weight = x.double() * logit_scale, w.double()
    per_logit = u * (h.abs() @ weight.abs().T + 3 * (h @ weight.T).abs())
    bound = (2 * per_logit.amax(-1))[labels != -100].mean().item()
    assert abs(ours - eager) <= bound, (ours, eager, bound)
    assert bound < 0.05 * abs(eager), "the bound must say something at this size"


def test_divisor_can_be_a_device_tensor():
    x, w, _, labels = _inputs(2)
    ours = _ours(labels, num_items=torch.tensor(40, device=DEV))(x, w)
    torch.testing.assert_close(ours, _eager(labels, num_items=40)(x, w), rtol=1e-5, atol=1e-6)


def test_all_ignored_rows_give_zero_loss_and_gradients():
    x, w, _, labels = _inputs(3)
    labels = torch.full_like(labels, -100)
    xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = _ours(labels)(xo, wo)
    loss.backward()
    assert loss.item() == 0.0
    assert not xo.grad.any() and not wo.grad.any()


def test_without_gradients_only_computes_the_loss():
    from kernels_triton import _loss

    x, w, _, labels = _inputs(4)
    loss, g_hidden, g_weight, g_bias = _loss._flce(x, w, labels, None, -100, 0.0, "mean", False, False,
                                                   1)  # chunk_mem_const: Liger's default
    torch.testing.assert_close(loss, _eager(labels)(x, w), rtol=1e-5, atol=1e-6)
    assert g_hidden.numel() == g_weight.numel() == g_bias.numel() == 0


@pytest.mark.parametrize("upstream", [3.0, -0.5])
def test_stored_gradients_are_scaled_by_the_upstream_gradient(upstream):
    x, w, _, labels = _inputs(5)
    xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (_ours(labels)(xo, wo) * upstream).backward()
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (_eager(labels)(xe, we) * upstream).backward()
    torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wo.grad, we.grad, rtol=1e-4, atol=1e-6)


def test_second_backward_through_the_same_graph_raises_instead_of_scaling_twice():
    x, w, _, labels = _inputs(1)
    loss = _ours(labels)(x.requires_grad_(True), w.requires_grad_(True))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _scale_error(grad: torch.Tensor, truth: torch.Tensor) -> float:
    """How far the least-squares factor between ``grad`` and ``truth`` is from 1: a rescaling of the whole gradient,
    which rounding noise (of either sign, element by element) hardly moves."""
    grad, truth = grad.double(), truth.double()
    return abs((grad * truth).sum().item() / (truth * truth).sum().item() - 1)


@pytest.mark.parametrize(("upstream", "num_items"), [(1.0, 53), (1 / 3, None)], ids=["num_items_53", "times_1_3"])
def test_upstream_gradient_scales_the_stored_gradients_in_float32(upstream, num_items):
    """The loss's upstream gradient, ``1 / num_items_in_batch`` (the adapter divides Liger's sum) or a
    gradient-accumulation factor, must scale Liger's stored bfloat16 gradients in float32, as eager's backward does:
    rounded to bfloat16 first it rescales every gradient of the model by ``delta`` (0.28% for 1/53, 0.20% for 1/3).
    Element-wise both round, so the bound is on the least-squares factor against float64: ours within ``delta / 2``
    of eager's (ours rounds twice, stored then scaled, which moved it by at most ``delta / 5`` in these runs)."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(6)
    n, hidden, vocab = 256, 32, 101
    x, w = torch.randn(n, hidden, generator=g).to(DEV), (torch.randn(vocab, hidden, generator=g) * 0.3).to(DEV)
    labels = torch.randint(0, vocab, (n,), generator=g).to(DEV)
    delta = abs(torch.tensor(upstream / (num_items or 1)).to(dtype).double().item() * (num_items or 1) / upstream - 1)
    assert delta > 2**-10, "the upstream gradient must be one that bfloat16 rounds noticeably"
    grad_out = [torch.tensor(upstream, device=DEV)]
    ours, eager = _ours(labels, num_items=num_items, chunk_rows=ONE_CHUNK), _eager(labels, num_items=num_items)
    _, g_ours = run_with_grads(ours, [x.to(dtype)], [w.to(dtype)], grad_out)
    _, g_eager = run_with_grads(eager, [x.to(dtype)], [w.to(dtype)], grad_out)
    _, g_truth = run_with_grads(eager, [x.to(dtype).double()], [w.to(dtype).double()], grad_out)
    for name, go, ge, gt in zip(("hidden", "weight"), g_ours, g_eager, g_truth, strict=True):
        ours_off, eager_off = _scale_error(go, gt), _scale_error(ge, gt)
        assert ours_off <= eager_off + delta / 2, \
            f"{name}: gradient rescaled by {ours_off:.2e} (eager {eager_off:.2e}; scale rounding {delta:.2e})"


def test_head_gradients_accumulate_in_float32_over_many_chunks():
    """Liger sums the head weight's and bias's gradients over its token chunks, in the parameter's dtype unless asked
    for float32: in bfloat16 over 64 chunks that was 2.8x (weight) and 6x (bias) eager's error, which rounds its
    single product once. In float32 the products round as eager's and only the float32 sums' order and the final
    rounding differ: at most 1.5x eager's error plus 2**-9 relative (one more rounding: bfloat16 rounds by at most
    2**-8 of a value, about half that on average)."""
    from kernels_triton import _loss

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(7)
    n, hidden, vocab, chunk_rows = 256, 16, 1024, 4
    x, w = torch.randn(n, hidden, generator=g).to(DEV), (torch.randn(vocab, hidden, generator=g) * 0.3).to(DEV)
    b, labels = torch.randn(vocab, generator=g).to(DEV), torch.randint(0, vocab, (n,), generator=g).to(DEV)
    with mock.patch.object(_loss, "_CHUNK_ROWS", chunk_rows):
        chunks = _loss._liger_chunks(n, vocab, hidden, _loss._chunk_mem_const(n, vocab, hidden))
    assert chunks == 64, chunks
    ours, eager = _ours(labels, chunk_rows=chunk_rows), _eager(labels)
    one = [torch.tensor(1.0, device=DEV)]
    _, g_ours = run_with_grads(ours, [x.to(dtype)], [w.to(dtype), b.to(dtype)], one)
    _, g_eager = run_with_grads(eager, [x.to(dtype)], [w.to(dtype), b.to(dtype)], one)
    _, g_truth = run_with_grads(eager, [x.to(dtype).double()], [w.to(dtype).double(), b.to(dtype).double()], one)
    for name, go, ge, gt in zip(("hidden", "weight", "bias"), g_ours, g_eager, g_truth, strict=True):
        e_ours, e_eager = rel_err(go, gt), rel_err(ge, gt)
        assert e_ours <= 1.5 * e_eager + 2**-9, f"{name}: error {e_ours:.2e} vs eager {e_eager:.2e}"


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_a_vocabulary_off_the_gemm_alignment_is_padded_for_the_products(softcap):
    """V = 101 is not a multiple of 8: Liger must see a weight of 128 rows (its logits rows 16-byte aligned, cuBLAS's
    fast GEMMs) with -inf bias on the padding, and the gradients come back with 101 rows. A soft-cap would turn -inf
    into -softcap, so then nothing is padded. The loss and gradients themselves are checked against eager above."""
    from liger_kernel.ops import fused_linear_cross_entropy as liger

    seen = []
    real = liger.fused_linear_cross_entropy_forward

    def spy(**kwargs):
        seen.append((tuple(kwargs["weight"].shape), kwargs["bias"]))
        if softcap is not None:  # the interpreter cannot run Liger's tanh: only the operands matter here
            w = kwargs["weight"]
            return (torch.zeros((), device=DEV), None, None, None, torch.zeros_like(kwargs["_input"]),
                    torch.zeros_like(w), None)
        return real(**kwargs)

    x, w, _, labels = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    with mock.patch.object(liger, "fused_linear_cross_entropy_forward", spy):
        _ours(labels, softcap=softcap)(x, w).backward()
    (shape, bias), = seen
    assert w.grad.shape == (V, H) and x.grad.shape == (N, H)
    if softcap is not None:
        assert shape == (V, H) and bias is None
        return
    assert shape == (128, H)
    assert torch.equal(bias[:V], torch.zeros(V, device=DEV)) and bool(torch.isneginf(bias[V:]).all())
