"""Gated MLPs that name no activation attribute are matched by what their forward computes.

Remote-code models apply ``F.silu`` inline, and another library's module (Liger-Kernel's ``LigerSwiGLUMLP``, which
the Trainer's ``use_liger_kernel`` puts in a model) keeps no ``act_fn``: the matcher tries each activation a core
kind covers against the module's output, and binds the one that matches or declines naming what it tried.
"""

from __future__ import annotations

import kernels_core
import pytest
import reference_plugin
import torch
import torch.nn.functional as F
from kernels_core import Mode
from torch import nn


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


class InlineGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with the activation written in the forward, no attribute holding it."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(16, 40, bias=False)
        self.up_proj = nn.Linear(16, 40, bias=False)
        self.down_proj = nn.Linear(40, 16, bias=False)
        self.activation = activation  # a string, not a callable: nothing for the attribute lookup to evaluate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


def _entry(module: nn.Module, pm, kind: str):
    kernels_core.kernelize(module, mode=Mode.TRAINING, plugin_manager=pm)
    (entry,) = [e for e in kernels_core.get_report(module).entries if e.kind == kind]
    return entry


# fp32: the kernel and eager round alike; bf16: one rounding of the product and of each projection's output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("activation", "kind"), [("silu", "silu_gated_mlp"), ("gelu_tanh", "gelu_gated_mlp")])
def test_an_inline_activation_is_matched_by_its_output(activation, kind, dtype, ref_pm):
    torch.manual_seed(0)
    eager = InlineGatedMLP(activation).to(dtype)
    kernelized = InlineGatedMLP(activation).to(dtype)
    kernelized.load_state_dict(eager.state_dict())
    entry = _entry(kernelized, ref_pm, kind)
    assert entry.kernel == f"ref.{kind}", entry.reason
    x = torch.randn(3, 7, 16, dtype=dtype)
    x_eager, x_kernel = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = eager(x_eager), kernelized(x_kernel)
    assert reference_plugin.CALLS[kind] > 0  # the kernel ran, not the module's own forward
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    torch.testing.assert_close(x_kernel.grad, x_eager.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(kernelized.gate_proj.weight.grad, eager.gate_proj.weight.grad, rtol=tol, atol=tol)


def test_an_inline_activation_no_kind_covers_is_declined_naming_what_was_tried(ref_pm):
    module = InlineGatedMLP("relu")
    entry = _entry(module, ref_pm, "silu_gated_mlp")
    assert entry.kernel is None
    assert "matches neither down(silu(gate)*up)" in entry.reason
    assert "down(gelu_tanh(gate)*up)" in entry.reason
    assert "names no activation attribute" in entry.reason


def test_a_named_activation_is_still_read_from_its_attribute(ref_pm):
    """An ``act_fn`` that is not SiLU or tanh-GELU declines before any probe, as before."""
    module = InlineGatedMLP("silu")
    module.act_fn = nn.ReLU()
    entry = _entry(module, ref_pm, "silu_gated_mlp")
    assert entry.kernel is None
    assert "activation is relu" in entry.reason or "activation is unrecognised" in entry.reason
