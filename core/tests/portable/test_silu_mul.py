"""The SiLU-gated product against Qwen3's eager MLP activation, forward and backward."""

from __future__ import annotations

import pytest
import torch
from kernels_core._portable._silu_mul import silu_mul
from transformers.activations import ACT2FN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_identical_to_eager(dtype):
    # Same ATen ops (silu, mul, silu_backward) in the same order, so equality is exact on any device.
    generator = torch.Generator().manual_seed(0)
    gate = (torch.randn(5, 33, generator=generator) * 4).to(dtype).requires_grad_()
    up = torch.randn(5, 33, generator=generator).to(dtype).requires_grad_()
    act = ACT2FN["silu"]

    expected = act(gate) * up
    upstream = torch.randn(expected.shape, generator=generator).to(dtype)
    expected_grads = torch.autograd.grad(expected, (gate, up), upstream)
    actual = silu_mul(gate, up)
    actual_grads = torch.autograd.grad(actual, (gate, up), upstream)

    assert actual.dtype == dtype
    assert torch.equal(actual, expected)
    assert torch.equal(actual_grads[0], expected_grads[0])
    assert torch.equal(actual_grads[1], expected_grads[1])


def test_only_one_input_needs_grad():
    gate = torch.randn(3, 4, requires_grad=True)
    up = torch.randn(3, 4)
    (grad,) = torch.autograd.grad(silu_mul(gate, up).sum(), gate)
    (expected,) = torch.autograd.grad((torch.nn.functional.silu(gate) * up).sum(), gate)
    assert torch.equal(grad, expected)


def test_saves_two_tensors_where_eager_saves_three():
    gate = torch.randn(64, 128, requires_grad=True)
    up = torch.randn(64, 128, requires_grad=True)

    def saved(fn) -> set[int]:
        storages: set[int] = set()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return storages

    assert len(saved(lambda: torch.nn.functional.silu(gate) * up)) == 3  # gate, silu(gate), up
    assert len(saved(lambda: silu_mul(gate, up))) == 2  # gate, up
