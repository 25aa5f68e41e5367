"""``linear_operands``: what a kernel reading a linear child's weight takes, or why it cannot (no PEFT needed here;
PEFT's LoRA and modules_to_save are covered end to end in ``tests/integrations/test_peft.py``)."""

from __future__ import annotations

import torch
from kernels_core._kinds._linear import linear_operands
from kernels_core._kinds._linear import wrapped_module
from torch import nn


class _Packed(torch.Tensor):
    """Stands for a quantized weight class (bitsandbytes' Params4bit): a tensor subclass F.linear dispatches."""


def test_plain_linear_gives_its_own_weight_and_bias():
    head = nn.Linear(6, 5)
    hidden = torch.randn(3, 6)
    x, weight, bias = linear_operands(head)(hidden)
    assert x is hidden and weight is head.weight and bias is head.bias


def test_a_linear_subclass_without_its_own_forward_is_plain():
    class Named(nn.Linear):
        pass

    assert callable(linear_operands(Named(4, 3)))


def test_weights_a_kernel_cannot_read_are_refused():
    head = nn.Linear(4, 3, bias=False)
    head.weight = nn.Parameter(torch.randn(3, 4).as_subclass(_Packed), requires_grad=False)
    assert "_Packed (quantized?)" in linear_operands(head)
    head.weight = nn.Parameter(torch.zeros(3, 4, dtype=torch.uint8), requires_grad=False)
    assert "not a floating-point dtype" in linear_operands(head)


def test_hooks_and_other_modules_are_refused():
    head = nn.Linear(4, 3)
    handle = head.register_forward_pre_hook(lambda module, args: None)
    assert "forward hooks" in linear_operands(head)
    handle.remove()
    assert callable(linear_operands(head))
    assert "Identity, not a linear layer" in linear_operands(nn.Identity())


def test_unknown_wrappers_are_not_looked_through():
    norm = nn.RMSNorm(4)
    assert wrapped_module(norm) is norm


def test_experts_with_quantized_weights_are_declined(pm):
    """The experts kernel reads gate_up_proj / down_proj as they are: a quantized tensor class is refused."""
    import kernels_core
    from kernels_core import Mode
    from kernels_core.testing import tiny_causal_lm

    model = tiny_causal_lm("qwen3_moe")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach().as_subclass(_Packed), requires_grad=False)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    entries = [e for e in kernels_core.get_report(model).entries if e.kind == "moe_experts"]
    assert entries and all(e.kernel is None and "_Packed (quantized?)" in e.reason for e in entries), entries
