from __future__ import annotations

import pytest
import torch


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Floors for the relative error against a float64 truth, per dtype, for outputs that are exactly rounded once or
# twice: float32 keeps ~7 digits, float16 has a 2**-11 unit roundoff and bfloat16 2**-8; the floors are a few
# units of roundoff so that two correct implementations that round at different points both pass.
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.double(), truth.double()
    return ((x - truth).norm() / truth.norm().clamp_min(1e-30)).item()


def assert_as_good_as_eager(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype,
                            what: str) -> None:
    """Ours may be at most twice as far from the float64 truth as eager in the same dtype, plus a small floor."""
    assert ours.shape == eager.shape, f"{what}: shape {tuple(ours.shape)} != eager {tuple(eager.shape)}"
    assert ours.dtype == eager.dtype, f"{what}: dtype {ours.dtype} != eager {eager.dtype}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    e_ours, e_eager = rel_err(ours, truth), rel_err(eager, truth)
    assert e_ours <= 2 * e_eager + FLOOR[dtype], f"{what}: error {e_ours:.2e} vs eager {e_eager:.2e} ({dtype})"
