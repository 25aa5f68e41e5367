"""kernels_npu._rotary against transformers' apply_rotary_pos_emb (NPU verified against the emulation only)."""

from __future__ import annotations

import pytest
import torch
from kernels_npu._rotary import apply_rotary
from npu_testing import assert_close
from npu_testing import assert_grad_close
from transformers import LlamaConfig
from transformers import Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _qk_cos_sin(rotary_cls, config, dtype, *, batch=2, seq=9, heads=4, kv_heads=2, head_dim=16):
    rotary = rotary_cls(config)
    x = torch.randn(batch, seq, 8, dtype=dtype)
    position_ids = torch.arange(3, 3 + seq).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary(x, position_ids)
    q = torch.randn(batch, heads, seq, head_dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype)
    return q, k, cos, sin


def _compare(reference, q, k, cos, sin, dtype, unsqueeze_dim=1):
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    eq, ek = reference(q1, k1, cos, sin, unsqueeze_dim)
    aq, ak = apply_rotary(q2, k2, cos, sin, unsqueeze_dim)
    assert_close(aq, eq, dtype, what="q")
    assert_close(ak, ek, dtype, what="k")
    gq, gk = torch.randn_like(eq), torch.randn_like(ek)
    ref = torch.autograd.grad((eq, ek), (q1, k1), (gq, gk))
    ours = torch.autograd.grad((aq, ak), (q2, k2), (gq, gk))
    assert_grad_close(ours[0], ref[0], dtype, what="grad q")
    assert_grad_close(ours[1], ref[1], dtype, what="grad k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_rotary_mul_matches_llama_full_rotary(dtype, emulation):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    q, k, cos, sin = _qk_cos_sin(LlamaRotaryEmbedding, config, dtype)
    _compare(llama_rope, q, k, cos, sin, dtype)
    modes = {args["rotary_mode"] for name, args in emulation.calls if name == "npu_rotary_mul"}
    assert modes == {"half"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_rotary_mul_matches_phi3_partial_rotary(dtype, emulation):
    config = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5)
    q, k, cos, sin = _qk_cos_sin(Phi3RotaryEmbedding, config, dtype)
    assert cos.shape[-1] == 8  # half of head_dim 16 is rotated
    _compare(phi3_rope, q, k, cos, sin, dtype)
    rotated = [args["self"].shape[-1] for name, args in emulation.calls if name == "npu_rotary_mul"]
    assert rotated == [8, 8]


def test_emulated_npu_rotary_mul_bsnd_layout_with_unsqueeze_dim_2():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    q, k, cos, sin = _qk_cos_sin(LlamaRotaryEmbedding, config, torch.float32)
    _compare(llama_rope, q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), cos, sin, torch.float32,
             unsqueeze_dim=2)


def test_emulated_npu_rotary_mul_shape_rules(emulation):
    x = torch.randn(1, 2, 3, 6)
    with pytest.raises(RuntimeError, match="even"):
        emulation.npu_rotary_mul(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5))
    with pytest.raises(RuntimeError, match="4-D"):
        emulation.npu_rotary_mul(x[0], torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    with pytest.raises(RuntimeError, match="dtype"):
        emulation.npu_rotary_mul(x, torch.randn(1, 1, 3, 6, dtype=torch.bfloat16), torch.randn(1, 1, 3, 6))
    with pytest.raises(RuntimeError, match="rotary_mode"):
        emulation.npu_rotary_mul(x, torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6), "quarter")


def test_odd_rotary_dim_raises():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q, q, torch.randn(1, 3, 5), torch.randn(1, 3, 5))
