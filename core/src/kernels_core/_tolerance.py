"""The tolerance table and probe comparisons of kernels-core's plugin API (published through
:mod:`kernels_core.plugin`, which documents them).

Example:
    >>> from kernels_core._tolerance import kernel_tolerance
    >>> kernel_tolerance("bfloat16") > kernel_tolerance("float32")
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import NamedTuple


if TYPE_CHECKING:
    import torch

__all__ = ["TOLERANCES", "Tolerance", "kernel_tolerance", "probe_close", "probe_tolerance", "rel_error",
           "rms_tolerance"]

class Tolerance(NamedTuple):
    """Relative-error bounds (``max|a - b| / max|b|``) of one dtype: ``probe``, below which a matcher's probe counts
    as the module computing the reference math (:func:`probe_tolerance`), and ``kernel``, for a kernel against the
    eager module it replaces (``kernels-core check``, ``kernels_core.testing.assert_close``); ``rms``, the bound of
    the root-mean-square relative error ``||a - b|| / ||b||`` of a kernel, which rounding differences spread over
    the elements keep far below the largest one while an error in the math (a 1% scale) does not."""

    probe: float
    kernel: float
    rms: float


TOLERANCES: Mapping[str, Tolerance] = MappingProxyType({
    "float64": Tolerance(probe=1e-8, kernel=1e-10, rms=1e-10),
    "float32": Tolerance(probe=1e-4, kernel=2e-5, rms=2e-5),
    "float16": Tolerance(probe=4e-3, kernel=4e-3, rms=4e-3),
    "bfloat16": Tolerance(probe=3e-2, kernel=2e-2, rms=2 * 2.0**-8),
})
"""The relative-error bounds of each dtype, by torch name, read by the core's matchers and checks alike.

``probe`` is generous enough for a module computing in another order than the reference, and tight enough that a
(1 + w) offset, another activation or a missing multiplier (errors of order 1) never passes. ``kernel``: bf16 keeps
8 mantissa bits (eps 2^-8 = 3.9e-3) and fp16 11 (eps 9.8e-4); a kernel that reduces in another order or keeps an
fp32 intermediate the eager code rounds differs by a few ulps of the output, so the bounds are a few eps; fp32
differences come from reduction order only. A few ulps of the largest output in bf16 is 2%, so bf16's ``rms``
bounds the error over all elements by twice its unit roundoff (7.8e-3): honest rounding differences stay well inside,
and a 1% error in the math fails in every dtype. In the other dtypes ``kernel`` already fails a 1% error; their
``rms`` is the same bound."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def probe_tolerance(dtype: torch.dtype | str) -> float:
    """The relative error below which a probe of a module in ``dtype`` counts as the reference math (3e-2 for a
    dtype not in :data:`TOLERANCES`).

    Example:
        >>> probe_tolerance("bfloat16") > probe_tolerance("float32")
        True
    """
    bounds = TOLERANCES.get(_dtype_name(dtype))
    return bounds.probe if bounds is not None else 3e-2


def rms_tolerance(dtype: torch.dtype | str) -> float:
    """The root-mean-square relative error a kernel may show against the eager module in ``dtype``.

    Example:
        >>> rms_tolerance("bfloat16") < 0.01 < kernel_tolerance("bfloat16")
        True
    """
    return TOLERANCES[_dtype_name(dtype)].rms


def kernel_tolerance(dtype: torch.dtype | str) -> float:
    """The relative error a kernel may show against the eager module in ``dtype``; ``KeyError`` for another dtype.

    Example:
        >>> kernel_tolerance("float32")
        2e-05
    """
    return TOLERANCES[_dtype_name(dtype)].kernel


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|``, computed in float64.

    Example:
        >>> import torch
        >>> rel_error(torch.tensor([1.0, 2.02]), torch.tensor([1.0, 2.0]))  # doctest: +ELLIPSIS
        0.00999...
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


def probe_close(actual: object, expected: torch.Tensor, dtype: torch.dtype | str) -> bool:
    """Whether a probe's output ``actual`` is the reference ``expected``: a tensor of the same shape and dtype, all
    finite, within :func:`probe_tolerance` of ``dtype`` (the module's parameter dtype).

    The dtype is part of the math: a kernel returns what the reference returns, and a module whose output dtype
    differs (a float32 result from a bfloat16 input) would break the next layer if its kernel did not.

    Example:
        >>> import torch
        >>> ones = torch.ones(3)
        >>> probe_close(ones, ones, torch.float32), probe_close(ones.double(), ones, "float32")
        (True, False)
    """
    import torch

    return (
        isinstance(actual, torch.Tensor)
        and actual.shape == expected.shape
        and actual.dtype == expected.dtype
        and bool(torch.isfinite(actual).all())
        and rel_error(actual, expected) <= probe_tolerance(dtype)
    )
