"""kernels_npu._moe against transformers 5 ``*Experts`` modules (NPU verified against the emulation only)."""

from __future__ import annotations

import pytest
import torch
from kernels_npu._moe import moe_experts
from npu_testing import assert_close
from npu_testing import assert_grad_close
from transformers import MixtralConfig
from transformers import Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS, HIDDEN, EXPERTS, TOP_K = 13, 24, 5, 2


def _experts(kind, dtype):
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=10, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, num_attention_heads=4, num_key_value_heads=2)
        module = Qwen3MoeExperts(config)
    else:
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=10, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K, num_attention_heads=4, num_key_value_heads=2)
        module = MixtralExperts(config)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.2)
    return module.to(dtype)


def _routing(dtype, tokens=TOKENS):
    logits = torch.randn(tokens, EXPERTS)
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_moe_matches_eager_experts(kind, dtype):
    module = _experts(kind, dtype)
    index, weights = _routing(dtype)
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    x_ref, x_npu = x.clone().requires_grad_(), x.clone().requires_grad_()
    w_ref, w_npu = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = module(x_ref, index, w_ref)
    actual = moe_experts(x_npu, index, w_npu, module.gate_up_proj, module.down_proj)
    assert_close(actual, expected, dtype, what="output")
    grad = torch.randn_like(expected)
    params = (module.gate_up_proj, module.down_proj)
    ref = torch.autograd.grad(expected, (x_ref, w_ref, *params), grad)
    ours = torch.autograd.grad(actual, (x_npu, w_npu, *params), grad)
    for a, e, what in zip(ours, ref, ("hidden", "routing weights", "gate_up_proj", "down_proj"), strict=True):
        assert_grad_close(a.float(), e.float(), dtype, what=f"grad {what}")


def test_emulated_npu_moe_skips_the_dropped_expert_sentinel():
    module = _experts("qwen3_moe", torch.float32)
    index, weights = _routing(torch.float32)
    index[::3, 1] = EXPERTS  # transformers' "no expert" sentinel (num_experts)
    x = torch.randn(TOKENS, HIDDEN)
    torch.testing.assert_close(moe_experts(x, index, weights, module.gate_up_proj, module.down_proj),
                               module(x, index, weights), rtol=1e-5, atol=1e-5)


def test_emulated_npu_moe_hot_path_never_synchronises_with_the_host(monkeypatch):
    module = _experts("qwen3_moe", torch.float32)
    index, weights = _routing(torch.float32)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in the MoE hot path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = moe_experts(x, index, weights, module.gate_up_proj, module.down_proj)
    out.sum().backward()
    monkeypatch.undo()
    assert x.grad is not None and module.gate_up_proj.grad is not None


def test_emulated_npu_moe_calls_the_documented_operator_chain(emulation):
    module = _experts("mixtral", torch.float32)
    index, weights = _routing(torch.float32)
    moe_experts(torch.randn(TOKENS, HIDDEN), index, weights, module.gate_up_proj, module.down_proj)
    assert [name for name, _ in emulation.calls] == [
        "npu_moe_token_permute", "npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul", "npu_moe_token_unpermute",
    ]


def test_emulated_moe_token_permute_rules(emulation):
    tokens = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="padded_mode"):
        emulation.npu_moe_token_permute(tokens, torch.zeros(4, 2, dtype=torch.int64), padded_mode=True)
    with pytest.raises(RuntimeError, match="int32/int64"):
        emulation.npu_moe_token_permute(tokens, torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="topk"):
        emulation.npu_moe_token_permute(tokens, torch.zeros(4, 513, dtype=torch.int64))
    permuted, sorted_indices = emulation.npu_moe_token_permute(tokens, torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]]))
    assert sorted_indices.dtype == torch.int32 and permuted.shape == (8, 8)
    with pytest.raises(RuntimeError, match="probs dtype"):
        emulation.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.ones(4, 2, dtype=torch.float64))
    restored = emulation.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((4, 2), 0.5))
    torch.testing.assert_close(restored, tokens)
