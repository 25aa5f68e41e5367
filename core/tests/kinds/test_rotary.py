"""Rotary functions are matched by what they return, whatever they do to their inputs.

Liger-Kernel's ``liger_rotary_pos_emb`` (which ``use_liger_kernel`` puts in a family's modeling module, process
wide) rotates q and k in place and returns them. The probe calls the function on copies, so its references and the
kernel trial read unrotated inputs: before, the in-place write made every layout look wrong and the layer was
declined with "probe output matches no rotary layout".
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from transformers import LlamaConfig
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_in_place(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, written into q and k as Liger-Kernel's rope does."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotated_q = q * cos + _rotate_half(q) * sin
    rotated_k = k * cos + _rotate_half(k) * sin
    q.copy_(rotated_q)
    k.copy_(rotated_k)
    return q, k


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotary_function_that_writes_in_place_is_matched(monkeypatch, ref_pm, dtype):
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotate_in_place)
    eager, kernelized = _llama().to(dtype), _llama().to(dtype)
    kernels_core.kernelize(kernelized, mode=Mode.TRAINING, plugin_manager=ref_pm)
    rows = [e for e in kernels_core.get_report(kernelized).entries if e.kind == "rotary_embedding"]
    assert [e.kernel for e in rows] == ["ref.rotary"] * 2, [e.reason for e in rows]
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        expected, actual = eager(ids).logits, kernelized(ids).logits
    # bf16: the kernelized model also runs the reference plugin's other kernels, each rounding once.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
