"""PyTorch-native implementations of each layer kind's calling convention.

They serve three purposes: kernels of their own (one fused ATen op such as ``F.rms_norm`` beats a Triton launch
for small inputs, and Inductor fuses plain ATen math with its neighbours under ``torch.compile``), the path the
Liger adapters take while Dynamo traces them (so Inductor never autotunes Liger's kernels), and the cases a Liger
kernel cannot reproduce exactly (for example dtype promotion between a float32 weight and a bfloat16 input).
Every function follows ``core/docs/kernel-conventions.md`` exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._compile import tracing


__all__ = ["gate_up_mul", "gelu_tanh_mul", "layer_norm", "moe_experts_dense", "residual_rms_norm", "rms_norm",
           "rms_norm_reference", "rotary_embedding", "silu_mul", "writes_input_dtype"]


def writes_input_dtype(hidden_states: torch.Tensor, weight: torch.Tensor, *, casting: str) -> bool:
    """Whether an RMSNorm kernel that writes its output in the input dtype reproduces the eager module here.

    GPU kernels (Liger's, kernels-triton's) write the input dtype. The Llama module multiplies the weight in the
    weight's dtype, so a float32 weight with a bfloat16 input promotes the output to float32: that combination,
    unknown castings and non-GPU tensors are left to the native path.

    Example:
        >>> writes_input_dtype(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), casting="llama")
        False
    """
    if casting == "llama" and weight.dtype != hidden_states.dtype:
        return False
    return casting in ("llama", "gemma") and hidden_states.is_cuda


def rms_norm_reference(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """The eager transformers math, operation for operation.

    Example:
        >>> x = torch.randn(2, 8)
        >>> rms_norm_reference(x, torch.ones(8), eps=1e-6, offset=0.0, casting="llama").shape
        torch.Size([2, 8])
    """
    x32 = hidden_states.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (normed * (offset + weight.float())).to(hidden_states.dtype)
    if casting != "llama":
        raise ValueError(f"unknown RMSNorm casting {casting!r}; expected 'llama' or 'gemma'")
    scale = weight + offset if offset else weight
    return scale * normed.to(hidden_states.dtype)


def rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm through ``torch.nn.functional.rms_norm`` (one fused kernel on CUDA) where it reproduces the eager math.

    ``F.rms_norm`` rounds once at the end where the Llama module rounds twice (after normalising, then after the
    weight); the difference is within one unit in the last place of the output dtype. The Gemma casting computes
    everything in float32 and rounds once, exactly like ``F.rms_norm`` over a float32 view.

    Example:
        >>> x = torch.randn(2, 8)
        >>> torch.allclose(rms_norm(x, torch.ones(8), eps=1e-6, offset=0.0, casting="llama"),
        ...                rms_norm_reference(x, torch.ones(8), eps=1e-6, offset=0.0, casting="llama"), atol=1e-6)
        True
    """
    if tracing():
        # Under torch.compile, hand Inductor the eager module's own ops: it fuses them into one kernel either way,
        # and on torch 2.11 / Triton 3.6 its fusion of F.rms_norm with Gemma2's residual adds produced a Triton
        # kernel that failed to compile (PassManager::run failed), a crash eager Gemma2 never hits.
        return rms_norm_reference(hidden_states, weight, eps=eps, offset=offset, casting=casting)
    shape = (hidden_states.shape[-1],)
    if casting == "gemma":
        scale = weight.float() + offset if offset else weight.float()
        return F.rms_norm(hidden_states.float(), shape, scale, eps).to(hidden_states.dtype)
    if casting == "llama" and not offset and weight.dtype == hidden_states.dtype:
        return F.rms_norm(hidden_states, shape, weight, eps)
    # A float32 weight with a half-precision input promotes the output to float32 in eager; keep that exact.
    return rms_norm_reference(hidden_states, weight, eps=eps, offset=offset, casting=casting)


def residual_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float,
    casting: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add in the inputs' dtype, then :func:`rms_norm`: ``(rms_norm(residual + x), residual + x)``.

    Eagerly two ATen kernels (the add, then ``F.rms_norm``); under ``torch.compile`` Inductor fuses the add into the
    norm's kernel itself, forward and backward.

    Example:
        >>> x, residual = torch.randn(2, 8), torch.randn(2, 8)
        >>> normed, new_residual = residual_rms_norm(x, residual, torch.ones(8), eps=1e-6, offset=0.0,
        ...                                          casting="llama")
        >>> torch.equal(new_residual, residual + x), normed.shape
        (True, torch.Size([2, 8]))
    """
    new_residual = residual + hidden_states
    return rms_norm(new_residual, weight, eps=eps, offset=offset, casting=casting), new_residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the input dtype.

    Example:
        >>> silu_mul(torch.zeros(2, 4), torch.ones(2, 4)).sum().item()
        0.0
    """
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` in the input dtype.

    Example:
        >>> gelu_tanh_mul(torch.zeros(2, 4), torch.ones(2, 4)).sum().item()
        0.0
    """
    return F.gelu(gate, approximate="tanh") * up


def gate_up_mul(gate_up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """:func:`silu_mul` (or with ``gelu``, :func:`gelu_tanh_mul`) of the halves of a concatenated ``[gate | up]``
    projection, the MoE experts' layout.

    Example:
        >>> gate_up_mul(torch.cat([torch.zeros(2, 4), torch.ones(2, 4)], dim=-1), gelu=False).shape
        torch.Size([2, 4])
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return gelu_tanh_mul(gate, up) if gelu else silu_mul(gate, up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``, rotating the first ``cos.shape[-1]`` dims (full or partial).

    Example:
        >>> q = k = torch.randn(1, 2, 3, 4)
        >>> cos, sin = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)
        >>> torch.equal(rotary_embedding(q, k, cos, sin)[0], q)
        True
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary = cos.shape[-1]
    if rotary == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary], q[..., rotary:]
    k_rot, k_pass = k[..., :rotary], k[..., rotary:]
    q_embed = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1)
    k_embed = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k_pass), dim=-1)
    return q_embed, k_embed


def layer_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension.

    Example:
        >>> layer_norm(torch.randn(2, 8), torch.ones(8), None, eps=1e-5).shape
        torch.Size([2, 8])
    """
    return F.layer_norm(hidden_states, (hidden_states.shape[-1],), weight, bias, eps)


def moe_experts_dense(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Experts computed densely with static shapes: every expert sees every token, weighted by its routing weight.

    ``E`` times the arithmetic of a routed implementation, but no data-dependent shapes, so it traces under
    ``torch.compile(fullgraph=True)``. :mod:`kernels_triton._experts` takes it for sizes its grouped products do
    not take; tests use it as a reference.

    Example:
        >>> moe_experts_dense(torch.randn(3, 4), torch.tensor([[0], [1], [0]]), torch.ones(3, 1),
        ...                   torch.randn(2, 6, 4), torch.randn(2, 4, 3)).shape
        torch.Size([3, 4])
    """
    out = torch.zeros_like(hidden_states)
    for expert in range(gate_up_proj.shape[0]):
        routing = (top_k_weights * (top_k_index == expert)).sum(dim=-1, keepdim=True)
        gated = gate_up_mul(F.linear(hidden_states, gate_up_proj[expert]), gelu=activation != "silu")
        out = out + (F.linear(gated, down_proj[expert]) * routing).to(out.dtype)
    return out
