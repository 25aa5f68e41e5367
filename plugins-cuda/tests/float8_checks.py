"""What the CPU and GPU tests of the FP8 linear kernels share: their bounds and the check of one product against the
bf16 layer, forward and backward.

Bounds, as max |a - b| / max |b| against the bf16 layer (derived in the core's ``_kinds/_dense.py``): one cast to
e4m3 is off by at most 2^-4 and to e5m2 by 2^-3, so 2^-4 + 2^-4 for a product of two e4m3 operands (every output,
the rowwise recipe's gradients) and 2^-3 + 2^-4 where the tensorwise recipe rounds the output gradient to e5m2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


E4M3, E5M2 = 2.0**-4, 2.0**-3
BOUND = E4M3 + E4M3
BOUND_GRAD = {"rowwise": E4M3 + E4M3, "tensorwise": E5M2 + E4M3}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, after checking shape, dtype and finiteness."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert bool(torch.isfinite(actual).all())
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max() / e.abs().max())


def request(recipe: str) -> dict:
    """kernelize's configuration asking for kernels-cuda's FP8 kernel of ``recipe`` on every decoder projection."""
    return {"kinds": {"linear": {"prefer": {"any": [f"cuda.linear.float8_{recipe}"]}}}}


class Checked(NamedTuple):
    """One checked product: its operands, output and gradients, and the bf16 layer's, for a caller's further checks."""

    operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    out: torch.Tensor
    got: tuple[torch.Tensor, ...]
    want: tuple[torch.Tensor, ...]


def check_against_bf16(linear: Callable[..., torch.Tensor], recipe: str, rows: int, k: int, n: int, bias: bool, *,
                       device: str) -> Checked:
    """``linear(x, w, b)`` on bf16 operands of these sizes against ``F.linear``: the output within :data:`BOUND`,
    the input and weight gradients within the recipe's gradient bound, and the output not bit-equal to bf16's (FP8
    really rounded)."""
    gen = torch.Generator(device=device).manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=gen, device=device) * 2 + 0.3).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(n, generator=gen, device=device).to(torch.bfloat16).requires_grad_() if bias else None
    grad = torch.randn(rows, n, generator=gen, device=device).to(torch.bfloat16)
    leaves = [t for t in (x, w, b) if t is not None]
    out = linear(x, w, b)
    got = torch.autograd.grad(out, leaves, grad)
    ref = torch.nn.functional.linear(x, w, b)
    want = torch.autograd.grad(ref, leaves, grad)
    assert rel(out, ref) <= BOUND
    assert rel(got[0], want[0]) <= BOUND_GRAD[recipe]
    assert rel(got[1], want[1]) <= BOUND_GRAD[recipe]
    assert not torch.equal(out, ref)  # rounded to 8 bits, not a bf16 product
    return Checked((x, w, b), out, got, want)
