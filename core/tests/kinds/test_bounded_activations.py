"""Gated MLPs and MoE experts that bound their activations are declined, not given a kernel that does not.

DeepSeek-V4 and Hunyuan-V4 clamp gate and up at ``swiglu_limit`` (10) before ``silu(gate) * up``. Random unit
probe rows never reach 10, so a probe at that scale alone sees the plain SwiGLU and binds a kernel that computes
something else once a trained model's pre-activations grow past the limit. The matchers probe large rows too.
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
import torch.nn.functional as F
from kernels_core import Mode
from torch import nn


LIMIT = 10.0


class SwiGLU(nn.Module):
    def __init__(self, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(16, 24, bias=False)
        self.up_proj = nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)
        self.act_fn = nn.SiLU()
        self.limit = limit

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:  # DeepseekV4MLP.forward
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj(self.act_fn(gate) * up)


class Experts(nn.Module):
    """transformers 5's ``*Experts`` layout (concatenated [gate; up], no bias), DeepSeek-V4's clamp optional."""

    def __init__(self, limit: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(4, 2 * 24, 16) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(4, 16, 24) * 0.2)
        self.act_fn = nn.SiLU()
        self.limit = limit

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            for expert in range(self.gate_up_proj.shape[0]):
                rows = top_k_index[:, slot] == expert
                gate, up = F.linear(hidden_states[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
                if self.limit is not None:  # DeepseekV4Experts._apply_gate
                    gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
                y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
                out[rows] += y * top_k_weights[rows, slot, None]
        return out


def _verdicts(module, ref_pm, kind):
    kernels_core.kernelize(module, mode=Mode.TRAINING, plugin_manager=ref_pm)
    return [e for e in kernels_core.get_report(module).entries if e.kind == kind]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_clamped_swiglu_is_declined_and_the_plain_one_bound(dtype, ref_pm):
    (plain,) = _verdicts(SwiGLU().to(dtype), ref_pm, "silu_gated_mlp")
    assert plain.kernel == "ref.silu_gated_mlp"
    (clamped,) = _verdicts(SwiGLU(LIMIT).to(dtype), ref_pm, "silu_gated_mlp")
    assert clamped.kernel is None
    assert "large pre-activations" in clamped.reason and "bounds its activations" in clamped.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_experts_are_declined_and_plain_ones_bound(dtype, ref_pm):
    (plain,) = _verdicts(Experts().to(dtype), ref_pm, "moe_experts")
    assert plain.kernel is not None
    (clamped,) = _verdicts(Experts(LIMIT).to(dtype), ref_pm, "moe_experts")
    assert clamped.kernel is None
    assert "large pre-activations" in clamped.reason and "bound their activations" in clamped.reason


def test_the_clamp_is_invisible_to_unit_rows():
    """What makes the large probe necessary: at the scale of the first probe the clamped module is the plain one."""
    plain, clamped = SwiGLU(), SwiGLU(LIMIT)
    clamped.load_state_dict(plain.state_dict())
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(plain(x), clamped(x))
        assert not torch.allclose(plain(x * 100), clamped(x * 100))
