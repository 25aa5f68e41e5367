"""kernels_npu._gmm: the autograd wrapper around npu_grouped_matmul (NPU verified against the emulation only)."""

from __future__ import annotations

import pytest
import torch
from kernels_npu._gmm import grouped_matmul


def _reference(x, weight, counts):
    rows = torch.repeat_interleave(torch.arange(weight.shape[0]), counts)
    return torch.einsum("mk,mkn->mn", x, weight[rows])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 3]])
def test_emulated_grouped_matmul_forward_and_backward_match_per_expert_matmuls(counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 6, dtype=torch.float64, requires_grad=True)
    w_param = torch.randn(4, 5, 6, dtype=torch.float64, requires_grad=True)  # [E, N, K] like gate_up_proj
    weight = w_param.transpose(1, 2)  # [E, K, N] view, as the MoE kernel passes it
    out = grouped_matmul(x.float(), weight.float(), counts)
    expected = _reference(x, weight, counts)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    ours = torch.autograd.grad(out.double(), (x, w_param), grad)
    ref = torch.autograd.grad(expected, (x, w_param), grad)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-5)


def test_emulated_grouped_matmul_backward_uses_documented_group_parameters(emulation):
    counts = torch.tensor([2, 1])
    x = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(2, 4, 5, requires_grad=True)
    grouped_matmul(x, weight, counts).sum().backward()
    params = [(a["split_item"], a["group_type"], a["group_list_type"]) for n, a in emulation.calls
              if n == "npu_grouped_matmul"]
    assert params[0] == (2, 0, 1)  # forward: m-axis grouping, per-group counts
    assert sorted(params[1:]) == [(2, 0, 1), (3, 2, 1)]  # dX m-axis, dW k-axis


def test_emulated_raw_npu_grouped_matmul_has_no_autograd(emulation):
    # Why the autograd.Function exists: the operator itself is not differentiable.
    x = torch.randn(3, 4, requires_grad=True)
    out = emulation.npu_grouped_matmul([x], [torch.randn(1, 4, 2)], group_list=torch.tensor([3]), split_item=2,
                                       group_type=0, group_list_type=1)[0]
    assert out.grad_fn is None and not out.requires_grad


def test_emulated_npu_grouped_matmul_rules(emulation):
    x, w = torch.randn(3, 4), torch.randn(2, 4, 2)
    with pytest.raises(RuntimeError, match="int64"):
        emulation.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2], dtype=torch.int32), split_item=2,
                                     group_type=0, group_list_type=1)
    with pytest.raises(RuntimeError, match="dtype"):
        emulation.npu_grouped_matmul([x], [w.half()], group_list=torch.tensor([1, 2]), split_item=2, group_type=0)
    with pytest.raises(RuntimeError, match="1..128"):
        emulation.npu_grouped_matmul([x] * 129, [w] * 129)
    cumsum = emulation.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]), split_item=2, group_type=0,
                                          group_list_type=0)[0]
    counts = emulation.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2]), split_item=2, group_type=0,
                                          group_list_type=1)[0]
    torch.testing.assert_close(cumsum, counts)
