"""Triton's interpreter, as these tests run it without a GPU, converts float32 to bfloat16 as a GPU does.

``conftest._interpreter_rounds_bfloat16_to_nearest`` patches the interpreter's conversion (it truncates, where a GPU
rounds to nearest even); on a GPU the compiled kernel itself is checked. Either way a kernel's ``.to(tl.bfloat16)``
and its implicit conversion on store must give exactly torch's rounding.
"""

from __future__ import annotations

import pytest
import torch


triton = pytest.importorskip("triton", reason="needs Triton (installed with liger-kernel)")
import triton.language as tl  # noqa: E402 - after the importorskip above


@triton.jit
def _convert(X, Y, EXPLICIT: tl.constexpr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(X + offsets)
    if EXPLICIT:
        x = x.to(tl.bfloat16)
    tl.store(Y + offsets, x)  # to Y's dtype, bfloat16


@pytest.mark.parametrize("explicit", [True, False], ids=["to", "store"])
def test_float32_to_bfloat16_rounds_to_nearest_even(explicit):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1 << 14
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0])  # ties: to even, both ways
    y = torch.empty(n, dtype=torch.bfloat16, device=device)
    _convert[(1,)](x, y, explicit, n)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16)), \
        f"{int((y != expected).sum())} of {n} values differ from round-to-nearest-even"
