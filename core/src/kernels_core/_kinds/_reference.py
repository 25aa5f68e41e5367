"""Eager reference math for every core layer kind, written from transformers' semantics.

Matchers compare a module's own forward against these to decide what it computes; plugin test suites use them
(through :mod:`kernels_core.testing`) as the ground truth their kernels must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


__all__ = [
    "causal_lm_loss",
    "gated_activation",
    "layer_norm",
    "moe_experts",
    "residual_rms_norm",
    "rms_norm",
    "rotary",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str) -> torch.Tensor:
    """RMSNorm as transformers computes it; ``casting`` is ``"llama"`` or ``"gemma"``.

    Example:
        >>> rms_norm(torch.ones(2, 4), torch.ones(4), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([2, 4])
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        scale = weight + offset if offset else weight
        return scale * normed.to(x.dtype)
    if casting == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    raise ValueError(f"casting {casting!r} must be 'llama' or 'gemma'")


def residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder layer's residual add and the RMSNorm after it: ``(rms_norm(residual + x), residual + x)``.

    The sum is taken in the inputs' dtype, as the eager layer does, and normalised as :func:`rms_norm` does.

    Example:
        >>> normed, new_residual = residual_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), eps=1e-6,
        ...                                          offset=0.0, casting="llama")
        >>> new_residual[0].tolist(), normed.shape
        ([2.0, 2.0, 2.0, 2.0], torch.Size([2, 4]))
    """
    new_residual = residual + hidden_states
    return rms_norm(new_residual, weight, eps=eps, offset=offset, casting=casting), new_residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def gated_activation(gate: torch.Tensor, up: torch.Tensor, *, activation: str) -> torch.Tensor:
    return _ACTIVATIONS[activation](gate) * up


def identify_activation(act: object, *, device: torch.device | None = None) -> str | None:
    """Name the activation ``act`` computes by evaluating it, or ``None`` if it is none of the known ones."""
    if not callable(act):
        return None
    t = torch.linspace(-6.0, 6.0, 97, device=device)
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:  # noqa: BLE001 - an activation that cannot take a plain tensor is simply unknown
        return None
    if not isinstance(out, torch.Tensor) or out.shape != t.shape:
        return None
    for name, fn in _ACTIVATIONS.items():
        if torch.allclose(out.float(), fn(t).float(), rtol=1e-5, atol=1e-6):
            return name
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    unsqueeze_dim: int = 1,
    style: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding; rotates the first ``cos.shape[-1]`` dims (partial rotary) and passes the rest.

    ``style="interleaved"`` pairs adjacent dims (GPT-J), with cos/sin given per pair repeated twice.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    rotate = _rotate_half if style == "half" else _rotate_interleaved

    def apply(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        out = x_rot * cos + rotate(x_rot) * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    return apply(q), apply(k)


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> torch.Tensor:
    """Cross-entropy over already-shifted labels, exactly as transformers' ``fixed_cross_entropy``.

    ``logit_scale`` multiplies the logits before any soft-capping, in their own dtype and then upcast, as eager
    Command-R (``* logit_scale``) and Granite (``/ logits_scaling``, passed as its inverse) compute them.

    Example:
        >>> h, w, labels = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, -100, 3])
        >>> halved = causal_lm_loss(h, w, labels, logit_scale=0.5)
        >>> bool(torch.allclose(halved, causal_lm_loss(h * 0.5, w, labels)))
        True
    """
    logits = F.linear(hidden_states, weight, bias)
    if logit_scale is not None:
        logits = logits * logit_scale
    logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, labels.to(logits.device), ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str,
) -> torch.Tensor:
    """Dense reference for a transformers 5 ``*Experts`` module (every token through its top-k experts)."""
    out = torch.zeros_like(hidden_states)
    for slot in range(top_k_index.shape[1]):
        experts = top_k_index[:, slot]
        gate_up = torch.einsum("th,tnh->tn", hidden_states, gate_up_proj[experts])
        gate, up = gate_up.chunk(2, dim=-1)
        act = gated_activation(gate, up, activation=activation)
        y = torch.einsum("ti,thi->th", act, down_proj[experts])
        out = out + (y * top_k_weights[:, slot, None]).to(out.dtype)
    return out
