"""kernels_npu._swiglu against eager transformers gated MLPs (NPU verified against the emulation only)."""

from __future__ import annotations

import pytest
import torch
from kernels_npu._swiglu import silu_mul
from npu_testing import assert_close
from npu_testing import assert_grad_close
from transformers import LlamaConfig
from transformers import Phi3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(out, tensors, grad):
    return torch.autograd.grad(out, tensors, grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_swiglu_matches_llama_mlp_split(dtype):
    config = LlamaConfig(hidden_size=24, intermediate_size=37, hidden_act="silu", num_attention_heads=4)
    mlp = LlamaMLP(config).to(dtype)
    x = torch.randn(3, 5, 24, dtype=dtype)
    expected = mlp(x)
    actual = mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    assert_close(actual, expected, dtype, what="output")
    params = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    grad = torch.randn_like(expected)
    pairs = zip(_grads(actual, params, grad), _grads(expected, params, grad), ("gate", "up", "down"), strict=True)
    for ours, ref, name in pairs:
        assert_grad_close(ours.float(), ref.float(), dtype, what=f"grad {name}_proj")


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_swiglu_matches_phi3_fused_gate_up_without_a_copy(emulation, dtype):
    config = Phi3Config(hidden_size=24, intermediate_size=37, hidden_act="silu", num_attention_heads=4)
    mlp = Phi3MLP(config).to(dtype)
    x = torch.randn(2, 9, 24, dtype=dtype)
    expected = mlp(x)
    gate_up = mlp.gate_up_proj(x)
    gate, up = gate_up.chunk(2, dim=-1)
    actual = mlp.down_proj(silu_mul(gate, up))
    assert_close(actual, expected, dtype, what="output")
    # The halves of one contiguous projection output go to npu_swiglu as that very tensor (no concatenation).
    name, args = emulation.calls[-1]
    assert name == "npu_swiglu" and args["self"].data_ptr() == gate_up.data_ptr()
    params = (mlp.gate_up_proj.weight, mlp.down_proj.weight)
    grad = torch.randn_like(expected)
    pairs = zip(_grads(actual, params, grad), _grads(expected, params, grad), ("gate_up", "down"), strict=True)
    for ours, ref, what in pairs:
        assert_grad_close(ours.float(), ref.float(), dtype, what=f"grad {what}_proj")


def test_emulated_swapped_halves_are_concatenated_gate_first(emulation):
    base = torch.randn(4, 10)
    up, gate = base.chunk(2, dim=-1)  # adjacent, but in the wrong order: must not be passed as the base
    out = silu_mul(gate, up)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)
    assert emulation.calls[-1][1]["self"].data_ptr() != base.data_ptr()


def test_emulated_npu_swiglu_rejects_odd_and_non_contiguous_input(emulation):
    with pytest.raises(RuntimeError, match="even"):
        emulation.npu_swiglu(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        emulation.npu_swiglu(torch.randn(8, 4).t())


def test_mismatched_gate_and_up_raise():
    with pytest.raises(ValueError, match="differ"):
        silu_mul(torch.randn(2, 4), torch.randn(2, 5))
