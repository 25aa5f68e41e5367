"""kernels-cuda's public operations: the size-tuned RMSNorm entry points and their size thresholds.

Everything another package (a benchmark, a tuning sweep, another plugin's tests) uses from kernels-cuda is here or
at the package's top level; the ``_``-prefixed modules are private and may change in any release.

- :func:`rms_norm` and :func:`residual_rms_norm`: what ``cuda.rms_norm.tuned`` and ``cuda.residual_rms_norm.tuned``
  run, ``F.rms_norm`` (or the native add + norm) below a size threshold and the Triton kernel from it;
- :func:`rms_norm_thresholds` and :func:`set_rms_norm_thresholds`: read or set those thresholds (in elements of
  the normalised input), one without autograd and one with it. They are read on every call, so a change applies
  to modules kernelized before it too. The defaults are the crossovers measured on an H100 and H200 (see the
  package README); another GPU or input mix may move them.

Importing this module imports torch (and kernels-triton's operations, which load Triton on first use); importing
``kernels_cuda`` does not import it.

Example:
    >>> import torch
    >>> from kernels_cuda import ops
    >>> ops.rms_norm(torch.randn(4, 64), torch.ones(64), eps=1e-6, offset=0.0, casting="llama").shape
    torch.Size([4, 64])
    >>> previous = ops.set_rms_norm_thresholds(min_elements_with_grad=0)   # Triton at every size with autograd
    >>> ops.rms_norm_thresholds().min_elements_with_grad
    0
    >>> ops.set_rms_norm_thresholds(**previous._asdict()).min_elements_with_grad   # restored; the pair it replaced
    0
    >>> ops.rms_norm_thresholds() == previous
    True
"""

from __future__ import annotations

from typing import NamedTuple

from . import _ops
from ._ops import residual_rms_norm
from ._ops import rms_norm


__all__ = ["RmsNormThresholds", "residual_rms_norm", "rms_norm", "rms_norm_thresholds", "set_rms_norm_thresholds"]


class RmsNormThresholds(NamedTuple):
    """The tuned RMSNorm's size thresholds, in elements of the normalised input: the Triton kernel from
    ``min_elements`` without autograd and from ``min_elements_with_grad`` with it, ``F.rms_norm`` below."""

    min_elements: int
    min_elements_with_grad: int


def rms_norm_thresholds() -> RmsNormThresholds:
    """The thresholds in force now.

    Example:
        >>> from kernels_cuda import ops
        >>> ops.rms_norm_thresholds().min_elements >= 0
        True
    """
    return RmsNormThresholds(_ops.TRITON_RMS_NORM_MIN_ELEMENTS, _ops.TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD)


def set_rms_norm_thresholds(*, min_elements: int | None = None,
                            min_elements_with_grad: int | None = None) -> RmsNormThresholds:
    """Set either threshold (``None`` keeps it) for this process and return the previous pair, to restore it.

    ``0`` takes the Triton kernel at every size, a value above any input's size keeps ``F.rms_norm`` everywhere.
    Under ``torch.compile`` neither applies: the native math is traced.

    Example:
        >>> from kernels_cuda import ops
        >>> previous = ops.set_rms_norm_thresholds(min_elements=0)
        >>> ops.rms_norm_thresholds().min_elements
        0
        >>> _ = ops.set_rms_norm_thresholds(**previous._asdict())
    """
    for name, value in (("min_elements", min_elements), ("min_elements_with_grad", min_elements_with_grad)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    previous = rms_norm_thresholds()
    if min_elements is not None:
        _ops.TRITON_RMS_NORM_MIN_ELEMENTS = min_elements
    if min_elements_with_grad is not None:
        _ops.TRITON_RMS_NORM_MIN_ELEMENTS_WITH_GRAD = min_elements_with_grad
    return previous
