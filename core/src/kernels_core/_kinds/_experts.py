"""MoE experts of transformers 5 (``*Experts`` modules holding 3-D ``gate_up_proj`` / ``down_proj``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import Decline
from .._types import Match
from . import _reference
from ._context import MatchContext
from ._context import close
from ._context import dtensor_placements
from ._context import large_activation
from ._context import rel_error
from ._linear import plain_weight_problem


__all__ = ["adapt_experts", "match_experts"]

_EXPECTED_FLAGS = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}
_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def match_experts(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Experts with concatenated [gate; up] weights, no bias, SiLU or tanh-GELU, verified by a routed probe."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    return ctx.verdict("moe_experts", module, lambda: _classify_experts(module, ctx))


def _classify_experts(module: nn.Module, ctx: MatchContext) -> Match | Decline:
    # Read inside the verdict: FSDP2-sharded weights are gathered by then.
    gate_up, down = module._parameters["gate_up_proj"], module._parameters["down_proj"]
    for name, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
        # The kernels read these tensors as they are: a quantized tensor class or packed integers would be misread.
        problem = plain_weight_problem(tensor, name)
        if problem:
            return Decline("moe_experts", problem)
    placements = dtensor_placements(gate_up)
    if placements is not None:
        return Decline("moe_experts", f"expert weights are DTensors {placements} (tensor or expert parallel); "
                                      "the kernels take plain tensors")
    params = list(inspect.signature(type(module).forward).parameters)[1:4]
    if tuple(params) != _FORWARD_ARGS and not (params and params[0] == "args"):
        return Decline("moe_experts", f"forward arguments {params} are not (hidden_states, top_k_index, "
                                      "top_k_weights)")
    for flag, expected in _EXPECTED_FLAGS.items():
        value = getattr(module, flag, expected)
        if value != expected:
            return Decline("moe_experts", f"{flag}={value} layout is not handled (needs {flag}={expected})")
    extra = sorted(set(module._parameters) - {"gate_up_proj", "down_proj"})
    if extra:
        return Decline("moe_experts", f"extra parameters {extra} (biases, scales) are not handled")
    n_experts, two_inter, hidden = gate_up.shape
    if down.shape != (n_experts, hidden, two_inter // 2):
        return Decline("moe_experts", f"down_proj shape {tuple(down.shape)} does not match gate_up_proj "
                                      f"{tuple(gate_up.shape)}")
    if gate_up.device.type == "meta":
        return Decline("moe_experts", "parameters are on the meta device; the math cannot be verified")
    activation = _reference.identify_activation(getattr(module, "act_fn", None), device=gate_up.device)
    if activation not in ("silu", "gelu_tanh"):
        return Decline("moe_experts", f"activation is {activation or 'unrecognised'}, not SiLU or tanh-GELU")
    dtype, device = gate_up.dtype, gate_up.device
    gen = ctx.generator(device)
    tokens, top_k = 6, min(2, n_experts)
    x = ctx.randn(tokens, hidden, device=device, dtype=dtype, gen=gen)
    scores = ctx.randn(tokens, n_experts, device=device, dtype=torch.float32, gen=gen)
    weights, index = torch.topk(scores.softmax(-1), top_k, dim=-1)
    weights = weights.to(dtype)
    try:
        outputs = ctx.run_probe(module, ctx.original_forward(module), x, index, weights)
    except Exception as exc:  # noqa: BLE001
        return Decline("moe_experts", f"probe forward raised {type(exc).__name__}: {exc}")
    with torch.no_grad():
        expected = _reference.moe_experts(x, index, weights, gate_up, down, activation=activation)
    if not bool(expected.abs().max() > 0):
        return Decline("moe_experts", "probe is inconclusive: the output is all zeros with these weights")
    if not all(close(actual, expected, dtype) for actual in outputs):
        err = max((rel_error(a, expected) if isinstance(a, torch.Tensor) and a.shape == expected.shape
                   else float("inf")) for a in outputs)
        return Decline("moe_experts", f"probe output differs from the routed gated-MLP reference "
                                      f"(rel. error {err:.1e}); math differs")
    # Random unit rows never reach an activation bound (DeepSeek-V4's and Hunyuan-V4's experts clamp gate and up at
    # their swiglu_limit): the same rows scaled until the largest pre-activation of a routed expert is
    # large_activation() must give the reference math too.
    with torch.no_grad():
        peak = max(float((x @ gate_up[e].T).abs().max()) for e in index.unique().tolist())
    if peak > 0:
        target = large_activation(dtype)
        large = (x.float() * (target / peak)).to(dtype)
        try:
            outputs_large = ctx.run_probe(module, ctx.original_forward(module), large, index, weights)
        except Exception as exc:  # noqa: BLE001
            return Decline("moe_experts", f"probe forward raised {type(exc).__name__} on large inputs: {exc}")
        with torch.no_grad():
            expected_large = _reference.moe_experts(large, index, weights, gate_up, down, activation=activation)
        if bool(torch.isfinite(expected_large).all()) and not all(close(a, expected_large, dtype)
                                                                   for a in outputs_large):
            err = max((rel_error(a, expected_large) if isinstance(a, torch.Tensor) and a.shape == expected_large.shape
                       else float("inf")) for a in outputs_large)
            return Decline("moe_experts", f"probe output differs from the routed gated-MLP reference at large "
                                          f"pre-activations (up to {target:g}; rel. error {err:.1e}), though not at "
                                          "small ones: the experts bound their activations (a clamp, as "
                                          "DeepSeek-V4's swiglu_limit), which the kernels do not")
    ctx.note_probe(module, "moe_experts", (x, index, weights), {}, outputs[0])
    # The kernel computes the whole routed MLP: no sub-module (an activation module) is ever called.
    return Match("moe_experts", activation, {"activation": activation, "num_experts": n_experts},
                 evidence=f"probe matches routed {activation}-gated experts",
                 bypasses=tuple(name for name, _ in module.named_children()))


def adapt_experts(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return impl(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)

    return forward
