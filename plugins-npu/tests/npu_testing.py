"""Shared test helpers: per-dtype tolerances and tiny transformers configs."""

from __future__ import annotations

import torch


__all__ = ["GRAD_TOLERANCES", "TOLERANCES", "assert_close", "assert_grad_close"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, what: str = "") -> None:
    """Compare with a tolerance justified per dtype (see TOLERANCES)."""
    rtol, atol = TOLERANCES[dtype]
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# The emulated operators compute in float32 and round once to the output dtype, while eager transformers code
# rounds after each step (e.g. RMSNorm normalises, rounds to bf16, then multiplies and rounds again). The two
# differ by a couple of units in the last place of the output dtype: bf16 has 8 significant bits (ulp 2^-7
# relative at worst), fp16 has 11 (2^-10), so the tolerances are ~2 ulps plus an absolute floor for values
# near zero. float32 differs only by summation order. Gradients go through a few such steps more, so their
# checks use GRAD_TOLERANCES.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}
GRAD_TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, what: str = "") -> None:
    rtol, atol = GRAD_TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
