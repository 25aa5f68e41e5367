"""CPU tests of the native implementations (the compile-mode kernels and the Liger adapters' fallbacks)."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from conftest import assert_as_good_as_eager
from kernels_triton import _native
from kernels_triton import _rms_norm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_rms_norm_llama_and_gemma_match_eager(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 97, dtype=dtype)
    llama = LlamaRMSNorm(97, eps=1e-6).to(dtype)
    gemma = GemmaRMSNorm(97, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    truth_llama = LlamaRMSNorm(97, eps=1e-6).double()
    truth_llama.weight.data = llama.weight.data.double()
    truth_gemma = GemmaRMSNorm(97, eps=1e-6).double()
    truth_gemma.weight.data = gemma.weight.data.double()
    ours = _native.rms_norm(x, llama.weight, eps=1e-6, offset=0.0, casting="llama")
    assert_as_good_as_eager(ours, llama(x), truth_llama(x.double()), dtype, "llama")
    ours = _native.rms_norm(x, gemma.weight, eps=1e-6, offset=1.0, casting="gemma")
    assert_as_good_as_eager(ours, gemma(x), truth_gemma(x.double()), dtype, "gemma")


def test_liger_adapter_falls_back_on_cpu_and_for_promoting_dtypes():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(32)  # float32 weight: eager promotes to float32
    out = _rms_norm.liger_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
    assert out.dtype == torch.float32
    assert torch.equal(out, _native.rms_norm_reference(x, w, eps=1e-6, offset=0.0, casting="llama"))


@pytest.mark.parametrize("rotary", [64, 32])
def test_native_rope_full_and_partial(rotary):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64)
    theta = torch.randn(1, 9, rotary // 2).repeat(1, 1, 2)
    cos, sin = theta.cos(), theta.sin()
    ours = _native.rotary_embedding(q, k, cos, sin)
    if rotary == 64:
        eager = apply_rotary_pos_emb(q, k, cos, sin)
    else:  # transformers' partial-rotary models rotate the first `rotary` dims and pass the rest through
        q_e, k_e = apply_rotary_pos_emb(q[..., :rotary], k[..., :rotary], cos, sin)
        eager = (torch.cat((q_e, q[..., rotary:]), -1), torch.cat((k_e, k[..., rotary:]), -1))
    torch.testing.assert_close(ours, eager, rtol=0, atol=0)


def test_dense_moe_matches_transformers_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=24, moe_intermediate_size=10, num_experts=5, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.2)
        experts.down_proj.normal_(std=0.2)
    x = torch.randn(11, 24)
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(11)])
    w = torch.rand(11, 2)
    out = _native.moe_experts_dense(x, idx, w, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(out, experts(x, idx, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_items", [None, 7], ids=["mean", "num_items_in_batch"])
def test_loss_adapter_falls_back_to_the_portable_loss_on_cpu(num_items):
    from kernels_core.testing import reference
    from kernels_triton._loss import fused_linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(9, 16, requires_grad=True)
    weight = torch.randn(23, 16, requires_grad=True)
    labels = torch.randint(0, 23, (9,))
    labels[2] = -100
    loss = fused_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100,
                                      num_items_in_batch=num_items, softcap=None)
    expected = reference.causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
