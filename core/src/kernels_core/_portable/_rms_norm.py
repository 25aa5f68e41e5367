"""RMSNorm through PyTorch's fused ``rms_norm``, in exactly the precision of the transformers module replaced.

transformers has two casting conventions, and they round differently in half precision:

- ``llama`` (Llama, Qwen, Mistral, ...): upcast to float32, normalise, cast back to the input dtype, *then*
  multiply by the weight (in the weight's dtype);
- ``gemma`` (Gemma, Qwen3-Next, ...): normalise and scale by ``offset + weight.float()`` all in float32, cast
  at the very end.

In training the norm is recomputed in backward (``torch.utils.checkpoint``, non-reentrant) instead of keeping
its float32 intermediates: autograd saves only the input and the weight, which eager saves anyway or which
the residual stream keeps alive. Eager keeps the float32 copy of the input *and* the normalised output;
in bfloat16 that is three input-sized tensors per norm, in float32 two. The recomputation runs the very same
ops, so gradients are bit-identical to eager.

Example:
    >>> import torch
    >>> from kernels_core._portable._rms_norm import rms_norm
    >>> x, w = torch.randn(2, 3, 8), torch.ones(8)
    >>> rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama").shape
    torch.Size([2, 3, 8])
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


__all__ = ["rms_norm"]

_CASTINGS = ("llama", "gemma")


def _normalize(x32: torch.Tensor, weight32: torch.Tensor | None, eps: float) -> torch.Tensor:
    fused = getattr(torch.nn.functional, "rms_norm", None)
    if fused is not None:
        return fused(x32, (x32.shape[-1],), weight=weight32, eps=eps)
    # torch < 2.4 has no fused op: the transformers formula, term for term.
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight32 is None else normed * weight32


def rms_norm(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
) -> torch.Tensor:
    """RMS-normalise the last dimension and scale by ``offset + weight``, following the ``rms_norm`` convention.

    Example:
        >>> import torch
        >>> x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
        >>> rms_norm(x, w, eps=1e-6, offset=1.0, casting="gemma").dtype
        torch.bfloat16

    Args:
        hidden_states: input of any shape; normalised over the last dimension.
        weight: ``[H]`` scale.
        eps: added to the mean square before the reciprocal square root.
        offset: ``0.0`` for standard RMSNorm, ``1.0`` for ``(1 + weight)`` norms (Gemma, Qwen3-Next).
        casting: ``"llama"`` or ``"gemma"``, see the module docstring.

    Returns:
        The normalised tensor, in the dtype the eager module returns.
    """
    if casting not in _CASTINGS:
        raise ValueError(f"unknown RMSNorm casting {casting!r}; expected one of {', '.join(_CASTINGS)}")
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        # No randomness inside, so no RNG state to stash and restore.
        return checkpoint(
            _rms_norm, hidden_states, weight, eps, offset, casting, use_reentrant=False, preserve_rng_state=False
        )
    return _rms_norm(hidden_states, weight, eps, offset, casting)


def _rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    x32 = hidden_states.to(torch.float32)
    if casting == "llama":
        scale = weight + offset if offset else weight
        return scale * _normalize(x32, None, eps).to(input_dtype)
    return _normalize(x32, offset + weight.float(), eps).to(input_dtype)
