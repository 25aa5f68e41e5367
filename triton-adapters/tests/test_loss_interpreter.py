"""Liger's fused linear cross-entropy custom op, run in Triton's interpreter on CPU tensors (no GPU needed).

The adapter routes CPU tensors to the core's portable loss, so these tests call the custom op itself: they check
this package's autograd formula around Liger's kernel (upstream-gradient scaling, the in-place scaling guard),
not Liger's speed. On a GPU the same properties are checked on CUDA tensors in ``test_liger_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


pytest.importorskip("liger_kernel", reason="needs liger-kernel (a dependency of kernels-cuda)")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; GPUs run test_liger_gpu.py")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 16, generator=g)
    w = torch.randn(101, 16, generator=g) * 0.1
    labels = torch.randint(0, 101, (37,), generator=g)
    labels[::5] = -100
    return x, w, labels


@pytest.mark.parametrize("chunk_mem_const", [1, 2, 64], ids=lambda c: f"chunk_mem_const={c}")
@pytest.mark.parametrize("upstream", [1.0, 3.0, -0.5])
def test_interpreter_custom_op_scales_stored_gradients_by_the_upstream_gradient(upstream, chunk_mem_const):
    from kernels_triton import _loss

    x, w, labels = _inputs()
    xo, wo = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, *_ = _loss._flce(xo, wo, labels, None, -100, 0.0, "mean", True, True, chunk_mem_const)
    (loss * upstream).backward()
    xe, we = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = F.cross_entropy(xe @ we.T, labels, ignore_index=-100)
    (ref * upstream).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wo.grad, we.grad, rtol=1e-4, atol=1e-6)


def test_interpreter_second_backward_through_the_same_graph_raises_instead_of_scaling_twice():
    from kernels_triton import _loss

    x, w, labels = _inputs(1)
    loss, *_ = _loss._flce(x.requires_grad_(True), w.requires_grad_(True), labels, None, -100, 0.0, "mean", True,
                           True, 2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
