"""kernels_npu._attention and _fusion_attention against transformers' eager/SDPA attention functions.

NPU behaviour verified against the reference emulation of npu_fusion_attention only, not on Ascend hardware.
"""

from __future__ import annotations

import pytest
import torch
from kernels_core.plugin import Decline
from kernels_core.plugin import Match
from kernels_npu._attention import NpuAttentionFunctions
from kernels_npu._attention import adapt
from kernels_npu._attention import attention_forward
from kernels_npu._attention import match
from kernels_npu._attention import normalize_mask
from kernels_npu._fusion_attention import fusion_attention
from npu_testing import assert_close
from npu_testing import assert_grad_close
from transformers import Gemma2Config
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.llama.modeling_llama import eager_attention_forward


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
B, HQ, HKV, D = 2, 6, 2, 12  # GQA 3:1, a head dim that is no power of two


def _module():
    config = LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)
    return LlamaAttention(config, layer_idx=0)


def _qkv(dtype, q_len, kv_len):
    q = torch.randn(B, HQ, q_len, D, dtype=dtype)
    k = torch.randn(B, HKV, kv_len, D, dtype=dtype)
    v = torch.randn(B, HKV, kv_len, D, dtype=dtype)
    return q, k, v


def _eager_float_mask(keep, dtype):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _causal_keep(q_len, kv_len):
    rows = torch.arange(q_len).unsqueeze(-1) + kv_len - q_len
    return (torch.arange(kv_len).unsqueeze(0) <= rows)[None, None].expand(B, 1, q_len, kv_len)


def _compare(module, dtype, q_len, kv_len, mask_for_ref, mask_for_npu, reference=eager_attention_forward):
    q, k, v = _qkv(dtype, q_len, kv_len)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    npu_in = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference(module, *ref_in, mask_for_ref, scaling=module.scaling, dropout=0.0)
    actual, weights = attention_forward(fusion_attention, module, *npu_in, mask_for_npu, scaling=module.scaling,
                                        dropout=0.0)
    assert weights is None and actual.shape == (B, q_len, HQ, D)
    assert_close(actual, expected, dtype, what="attention output")
    grad = torch.randn_like(expected)
    for ours, ref, what in zip(torch.autograd.grad(actual, npu_in, grad), torch.autograd.grad(expected, ref_in, grad),
                               "qkv", strict=True):
        assert_grad_close(ours, ref, dtype, what=f"grad {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_len", "kv_len"), [(7, 7), (3, 10)], ids=["prefill", "chunk_after_cache"])
def test_emulated_causal_without_mask_uses_bottom_right_sparse_mode_3(dtype, q_len, kv_len, emulation):
    module = _module()
    _compare(module, dtype, q_len, kv_len, _eager_float_mask(_causal_keep(q_len, kv_len), dtype), None)
    (name, args), = [c for c in emulation.calls if c[0] == "npu_fusion_attention"]
    assert args["sparse_mode"] == 3 and args["atten_mask"].shape == (2048, 2048)
    assert args["head_num"] == HQ and args["scale"] == module.scaling


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_sdpa_boolean_padding_mask(dtype, emulation):
    keep = _causal_keep(9, 9).clone()
    keep[1, :, :, 6:] = False  # right padding in the second sequence
    keep[1, :, 6:, :] = _causal_keep(9, 9)[1, :, 6:, :]  # padded queries still see earlier keys
    module = _module()
    _compare(module, dtype, 9, 9, keep, keep, reference=sdpa_attention_forward)
    (name, args), = [c for c in emulation.calls if c[0] == "npu_fusion_attention"]
    assert args["sparse_mode"] == 0 and args["atten_mask"].dtype == torch.bool
    assert torch.equal(args["atten_mask"], ~keep)  # 1 = masked out, the opposite of SDPA's convention


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_eager_additive_mask_with_sliding_window(dtype):
    keep = _causal_keep(11, 11) & (torch.arange(11)[None, :] > torch.arange(11)[:, None] - 4)[None, None]
    float_mask = _eager_float_mask(keep, dtype)
    _compare(_module(), dtype, 11, 11, float_mask, float_mask)


def test_emulated_sliding_window_without_mask_builds_one():
    keep = _causal_keep(10, 10) & (torch.arange(10)[None, :] > torch.arange(10)[:, None] - 3)[None, None]
    q, k, v = _qkv(torch.float32, 10, 10)
    module = _module()
    expected, _ = eager_attention_forward(module, q, k, v, _eager_float_mask(keep, torch.float32),
                                          scaling=module.scaling)
    actual, _ = attention_forward(fusion_attention, module, q, k, v, None, scaling=module.scaling, sliding_window=3)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_emulated_flash_style_2d_padding_mask():
    padding = torch.ones(B, 8, dtype=torch.long)
    padding[0, 5:] = 0
    keep = _causal_keep(8, 8) & padding.bool()[:, None, None, :]
    q, k, v = _qkv(torch.float32, 8, 8)
    module = _module()
    expected, _ = eager_attention_forward(module, q, k, v, _eager_float_mask(keep, torch.float32),
                                          scaling=module.scaling)
    actual, _ = attention_forward(fusion_attention, module, q, k, v, padding, scaling=module.scaling)
    torch.testing.assert_close(actual[0, :5], expected[0, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-5)


def test_emulated_single_decoding_query_attends_everything(emulation):
    module = _module()
    _compare(module, torch.float32, 1, 9, None, None)
    (name, args), = [c for c in emulation.calls if c[0] == "npu_fusion_attention"]
    assert args["sparse_mode"] == 0 and args["atten_mask"] is None


def test_emulated_bidirectional_module_is_not_causal(emulation):
    module = _module()
    module.is_causal = False
    _compare(module, torch.float32, 6, 6, None, None)
    (name, args), = [c for c in emulation.calls if c[0] == "npu_fusion_attention"]
    assert args["atten_mask"] is None


def test_emulated_layout_follows_memory(emulation):
    module = _module()
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(torch.float32, 5, 5))
    attention_forward(fusion_attention, module, q, k, v, None, scaling=module.scaling)
    attention_forward(fusion_attention, module, q.contiguous(), k.contiguous(), v.contiguous(), None,
                      scaling=module.scaling)
    layouts = [a["input_layout"] for n, a in emulation.calls if n == "npu_fusion_attention"]
    assert layouts == ["BSND", "BNSD"]  # projections' BSND memory goes in as-is; no copy


def test_softcap_and_sinks_are_refused():
    q, k, v = _qkv(torch.float32, 3, 3)
    with pytest.raises(ValueError, match="softcapping"):
        attention_forward(fusion_attention, _module(), q, k, v, None, softcap=50.0)
    with pytest.raises(ValueError, match="sinks"):
        attention_forward(fusion_attention, _module(), q, k, v, None, s_aux=torch.zeros(HQ))


def test_flex_block_masks_are_refused():
    with pytest.raises(TypeError, match="flex_attention"):
        normalize_mask(object(), q_len=2, kv_len=2, causal=True, sliding_window=None)


def test_match_attention_modules_only():
    verdict = match(_module(), "model.layers.0.self_attn", None)
    assert isinstance(verdict, Match) and verdict.variant == "causal"
    assert verdict.params == {"global_name": "ALL_ATTENTION_FUNCTIONS"}
    config = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4)
    assert match(LlamaMLP(config), "model.layers.0.mlp", None) is None
    gemma2 = Gemma2Attention(Gemma2Config(hidden_size=24, num_attention_heads=4, head_dim=6,
                                          attn_logit_softcapping=50.0), layer_idx=0)
    declined = match(gemma2, "model.layers.0.self_attn", None)
    assert isinstance(declined, Decline) and "softcapping" in declined.reason


def test_adapter_hands_out_the_npu_function_for_any_name():
    funcs = adapt(_module(), Match("attention", "causal"), fusion_attention, {})
    assert isinstance(funcs, NpuAttentionFunctions)
    assert funcs.get_interface("sdpa", eager_attention_forward) == funcs["eager"] == funcs.get("flex_attention")


def test_emulated_fusion_attention_rules(emulation):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="2048x2048"):
        emulation.npu_fusion_attention(q, q, q, 2, "BNSD", atten_mask=torch.ones(4, 4, dtype=torch.bool),
                                       sparse_mode=3)
    with pytest.raises(RuntimeError, match="bool or uint8"):
        emulation.npu_fusion_attention(q, q, q, 2, "BNSD", atten_mask=torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="multiple"):
        emulation.npu_fusion_attention(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), 2, "BNSD")
    with pytest.raises(RuntimeError, match="input_layout"):
        emulation.npu_fusion_attention(q, q, q, 2, "NSD")
    result = emulation.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.3)
    assert len(result) == 7 and [type(x) for x in result[4:]] == [int, int, int]
    bsh = emulation.npu_fusion_attention(*(t.transpose(1, 2).reshape(1, 4, 16) for t in (q, q, q)), 2, "BSH",
                                         scale=0.3)[0]
    torch.testing.assert_close(bsh, result[0].transpose(1, 2).reshape(1, 4, 16))
