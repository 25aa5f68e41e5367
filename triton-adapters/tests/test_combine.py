"""The MoE experts' combine kernel (``kernels_triton._combine``) against the native gather, product and sum.

Forward and backward (the expert rows' and the weights' gradients) in three dtypes, with float64 as the truth
(conftest's rule), for one, two and eight slots per token and hidden sizes that leave a partial column block or
need several: through its ``autograd.Function`` (the eager path) and through the ``kernels_triton::experts_combine``
custom op with its registered backward (what ``torch.compile`` traces). On a GPU the kernel runs compiled; without
one, in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from conftest import compare_with_eager


pytest.importorskip("triton", reason="the combine kernel needs Triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _native(position, tokens, top_k):
    def combine(rows, weights):
        unsorted = rows[position].view(tokens, top_k, rows.shape[-1])
        return (unsorted * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)
    return combine


def _custom_op(rows, position, weights):
    from kernels_triton._combine import combine_op

    return combine_op(rows, position, weights)


def _autograd_function(rows, position, weights):
    from kernels_triton._combine import combine

    return combine(rows, position, weights)


@pytest.mark.parametrize("combine", [_autograd_function, _custom_op], ids=["function", "custom_op"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(37, 1, 40), (53, 2, 96), (19, 8, 1100), (3, 2, 2048)])
def test_combine_matches_native(tokens, top_k, hidden, dtype, combine):
    gen = torch.Generator().manual_seed(tokens)
    # Where each (token, slot) landed in expert order: any permutation of the rows.
    position = torch.randperm(tokens * top_k, generator=gen).to(DEV)
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(DEV)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEV)
    compare_with_eager(lambda r, w: combine(r, position, w), _native(position, tokens, top_k), [rows], [weights],
                       dtype, f"combine K={top_k} H={hidden}")


def test_float32_weights_with_low_precision_rows_keep_their_dtype():
    from kernels_triton._combine import combine

    rows = torch.randn(6, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(3, 2, device=DEV, requires_grad=True)
    out = combine(rows, torch.arange(6, device=DEV), weights)
    out.float().sum().backward()
    assert out.dtype == rows.grad.dtype == torch.bfloat16
    assert weights.grad.dtype == torch.float32
    torch.testing.assert_close(weights.grad, rows.float().sum(-1).view(3, 2), rtol=1e-5, atol=1e-5)


def test_unit_weights_sum_each_rows_copies():
    """The experts' gather backward (each token's K row gradients summed, in token order) is the forward with unit
    weights: checked against the index_select and sum it replaces, exactly in float32 for small integers."""
    from kernels_triton._combine import combine_forward

    tokens, top_k = 11, 8
    position = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(0)).to(DEV)
    rows = torch.randint(-8, 8, (tokens * top_k, 72), device=DEV).float()
    expected = rows.index_select(0, position).view(tokens, top_k, 72).sum(dim=1)
    assert torch.equal(combine_forward(rows, position, rows.new_ones(tokens, top_k)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_ops_pass_opcheck(dtype):
    """The ops ``torch.compile`` traces: schema, fake implementations against the real outputs, the registered
    autograd and tracing with dynamic shapes (``torch.library.opcheck``)."""
    from kernels_triton import _combine  # noqa: F401 - registers the ops

    tokens, top_k, hidden = 7, 3, 40
    position = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(1)).to(DEV)
    rows = torch.randn(tokens * top_k, hidden, device=DEV, dtype=dtype, requires_grad=True)
    weights = torch.rand(tokens, top_k, device=DEV, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.kernels_triton.experts_combine, (rows, position, weights))
    # The backward op is not differentiable again (no double backward): checked without requires_grad.
    grad = torch.randn(tokens, hidden, device=DEV, dtype=dtype)
    torch.library.opcheck(torch.ops.kernels_triton.experts_combine_backward,
                          (grad, rows.detach(), position, weights.detach()))
