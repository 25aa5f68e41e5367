"""Matcher and adapter of the ``plain_mlp`` kind. Calling convention: ``fn(hidden, *, approximate) -> act(hidden)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kernels_core import Decline
from kernels_core import Match
from torch import nn


__all__ = ["adapt_plain_mlp", "match_plain_mlp"]

_PAIRS = (("c_fc", "c_proj"), ("fc1", "fc2"), ("dense_h_to_4h", "dense_4h_to_h"))
_ACTIVATIONS = {"gelu_tanh": "tanh", "gelu": "none"}


def _projections(module: nn.Module) -> tuple[str, str] | None:
    for first, second in _PAIRS:
        if isinstance(module._modules.get(first), nn.Linear) and isinstance(module._modules.get(second), nn.Linear):
            return first, second
    return None


def match_plain_mlp(module: nn.Module, name: str, ctx: Any) -> Match | Decline | None:
    """Non-gated MLPs, verified by probing the module in eval and training behaviour."""
    names = _projections(module)
    if names is None or any(n in module._modules for n in ("gate_proj", "up_proj", "gate_up_proj")):
        return None
    act = getattr(module, "act", None) or getattr(module, "activation_fn", None) or getattr(module, "act_fn", None)
    if act is None:
        return Decline("plain_mlp", "no activation attribute (act / activation_fn / act_fn)")
    fc1, fc2 = (module._modules[n] for n in names)
    weight = fc1.weight
    if weight.device.type == "meta":
        return Decline("plain_mlp", "parameters are on the meta device; the math cannot be verified")
    x = torch.randn(1, 3, fc1.in_features, generator=torch.Generator().manual_seed(0)).to(weight)
    outputs = ctx.run_probe(module, ctx.original_forward(module), x)
    with torch.no_grad():
        hidden = fc1(x)
        for variant, approximate in _ACTIVATIONS.items():
            expected = fc2(nn.functional.gelu(hidden, approximate=approximate))
            atol = 1e-4 * float(expected.abs().max())
            if all(isinstance(o, torch.Tensor) and torch.allclose(o, expected, rtol=1e-3, atol=atol) for o in outputs):
                return Match("plain_mlp", variant, {"fc1": names[0], "fc2": names[1], "approximate": approximate},
                             evidence=f"probe matches {names[1]}(gelu({names[0]}(x)))")
    return Decline("plain_mlp", "probe output is not fc2(gelu(fc1(x))) in eval and training behaviour")


def adapt_plain_mlp(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    fc1, fc2, approximate = (module._modules[str(match.params["fc1"])], module._modules[str(match.params["fc2"])],
                             str(match.params["approximate"]))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return fc2(impl(fc1(hidden_states), approximate=approximate))

    return forward
