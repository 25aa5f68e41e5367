"""Matcher and adapter of the ``plain_mlp`` kind. Calling convention: ``fn(hidden, *, approximate) -> act(hidden)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kernels_core.plugin import Decline
from kernels_core.plugin import Match
from kernels_core.plugin import MatchContext
from kernels_core.plugin import probe_close
from torch import nn


__all__ = ["adapt_plain_mlp", "match_plain_mlp"]

_PAIRS = (("c_fc", "c_proj"), ("fc1", "fc2"), ("dense_h_to_4h", "dense_4h_to_h"))
_ACTIVATIONS = {"gelu_tanh": "tanh", "gelu": "none"}


def _projections(module: nn.Module) -> tuple[str, str] | None:
    for first, second in _PAIRS:
        if isinstance(module._modules.get(first), nn.Linear) and isinstance(module._modules.get(second), nn.Linear):
            return first, second
    return None


def match_plain_mlp(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
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
    eval_out, train_out = ctx.run_probe(module, ctx.original_forward(module), x)
    if not all(isinstance(o, torch.Tensor) for o in (eval_out, train_out)):
        return Decline("plain_mlp", "forward does not return a tensor")
    variant = _gelu_variant(act)
    if variant is None:
        return Decline("plain_mlp", "the activation is neither tanh-approximated nor exact GELU")
    with torch.no_grad():
        expected = fc2(nn.functional.gelu(fc1(x), approximate=_ACTIVATIONS[variant]))
    if not all(probe_close(o, expected, weight.dtype) for o in (eval_out, train_out)):
        return Decline("plain_mlp", "probe output is not fc2(gelu(fc1(x))) in eval and training behaviour")
    return Match("plain_mlp", variant, {"fc1": names[0], "fc2": names[1], "approximate": _ACTIVATIONS[variant]},
                 evidence=f"probe matches {names[1]}(gelu({names[0]}(x))), {variant}")


def _gelu_variant(act: Any) -> str | None:
    """Which GELU the activation computes, judged in float32: the two differ by ~1e-3 relative at most, below the
    rounding of a half-precision probe of the whole module."""
    t = torch.linspace(-5.0, 5.0, 101)
    try:
        with torch.no_grad():
            out = act(t)
    except Exception:  # noqa: BLE001 - an activation that cannot take a plain tensor is not one of ours
        return None
    for variant, approximate in _ACTIVATIONS.items():
        if isinstance(out, torch.Tensor) and torch.allclose(out, nn.functional.gelu(t, approximate=approximate),
                                                            rtol=1e-6, atol=1e-6):
            return variant
    return None


def adapt_plain_mlp(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict[str, Any]
                    ) -> Callable[..., Any]:
    fc1, fc2, approximate = (module._modules[str(match.params["fc1"])], module._modules[str(match.params["fc2"])],
                             str(match.params["approximate"]))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return fc2(impl(fc1(hidden_states), approximate=approximate))

    return forward
