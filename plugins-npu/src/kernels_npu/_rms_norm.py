"""RMSNorm over ``torch_npu.npu_rms_norm`` (the ``rms_norm`` kind, variants ``standard`` and ``offset``), also after
a decoder layer's residual add (the ``residual_rms_norm`` kind)."""

from __future__ import annotations

import torch

from ._torch_npu import load_torch_npu


__all__ = ["residual_rms_norm", "rms_norm"]


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMS-normalise the last dimension with ``npu_rms_norm``, following the ``rms_norm`` calling convention.

    ``npu_rms_norm(x, gamma, epsilon)`` returns ``(y, rstd)`` and requires ``gamma`` in ``x``'s dtype; it has no
    offset argument, so the ``(1 + weight)`` variant passes ``offset + weight`` as gamma (passing the raw,
    zero-initialised weight is the bug that gave LLaMA-Factory all-zero outputs on Qwen3.5). Autograd goes
    through the operator's registered backward, and through the gamma cast back to ``weight``'s dtype.

    Example:
        >>> y = rms_norm(x, layer.weight, eps=1e-6, offset=0.0, casting="llama")  # doctest: +SKIP
    """
    npu = load_torch_npu()
    dtype = hidden_states.dtype
    if casting == "gemma":
        # Gemma computes (offset + w) in float32 and casts the product once, so the result is in x's dtype.
        gamma = (weight.float() + offset).to(dtype)
        return npu.npu_rms_norm(hidden_states, gamma, epsilon=float(eps))[0]
    if casting == "llama":
        # Llama multiplies in the promoted dtype of weight and x: normalise in x's dtype (the operator's native
        # one), then cast the result up when the weight is wider (fp32 master weights with bf16 activations).
        scale = weight + offset if offset else weight
        out = npu.npu_rms_norm(hidden_states, scale.to(dtype), epsilon=float(eps))[0]
        return out.to(torch.promote_types(scale.dtype, dtype))
    raise ValueError(f"rms_norm: unknown casting {casting!r}; expected 'llama' or 'gemma'")


def residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add in PyTorch, then :func:`rms_norm`: ``(rms_norm(residual + x), residual + x)``.

    Follows the ``residual_rms_norm`` calling convention and keeps the post-attention norm on ``npu_rms_norm``
    when that kind is bound, so it computes what the ``rms_norm`` kind alone would. torch_npu's fused
    ``npu_add_rms_norm`` is not wired: it cannot be verified without hardware.

    Example:
        >>> y, new_residual = residual_rms_norm(x, residual, layer.weight, eps=1e-6, offset=0.0,
        ...                                     casting="llama")  # doctest: +SKIP
    """
    new_residual = residual + hidden_states
    return rms_norm(new_residual, weight, eps=eps, offset=offset, casting=casting), new_residual
