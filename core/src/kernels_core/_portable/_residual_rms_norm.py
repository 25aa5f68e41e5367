"""A pre-norm decoder layer's residual add and the RMSNorm after it, in exactly the eager module's precision.

The sum is taken in the inputs' dtype, as the eager layer does, and normalised by the portable
:func:`~kernels_core._portable._rms_norm.rms_norm`, which recomputes the norm in backward instead of keeping its
float32 intermediates. Pure PyTorch cannot fuse the add into the norm, so this saves what the portable RMSNorm
saves and nothing more; it serves the ``residual_rms_norm`` kind on CPU, the only backend it is declared for,
so that elsewhere a backend's own RMSNorm kernel keeps the post-attention norms.

Example:
    >>> import torch
    >>> from kernels_core._portable._residual_rms_norm import residual_rms_norm
    >>> x, residual, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.ones(8)
    >>> normed, new_residual = residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
    >>> bool(torch.equal(new_residual, residual + x))
    True
"""

from __future__ import annotations

import torch

from ._rms_norm import rms_norm


__all__ = ["residual_rms_norm"]


def residual_rms_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + hidden_states), residual + hidden_states)``, the ``residual_rms_norm`` convention.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 8, dtype=torch.bfloat16)
        >>> normed, new_residual = residual_rms_norm(x, x, torch.zeros(8, dtype=torch.bfloat16), eps=1e-6,
        ...                                          offset=1.0, casting="gemma")
        >>> normed.dtype, new_residual.dtype
        (torch.bfloat16, torch.bfloat16)

    Args:
        hidden_states: the attention output, ``[..., H]``.
        residual: the layer's input, same shape.
        weight: ``[H]`` scale of the norm.
        eps: added to the mean square before the reciprocal square root.
        offset: ``0.0`` for standard RMSNorm, ``1.0`` for ``(1 + weight)`` norms (Gemma).
        casting: ``"llama"`` or ``"gemma"`` (see :mod:`kernels_core._portable._rms_norm`).

    Returns:
        The normalised sum in the dtype the eager norm returns, and the sum in the inputs' dtype.
    """
    new_residual = residual + hidden_states
    return rms_norm(new_residual, weight, eps=eps, offset=offset, casting=casting), new_residual
