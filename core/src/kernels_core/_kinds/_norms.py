"""RMSNorm and LayerNorm: matchers that verify the math by probing, and adapters that call a kernel."""

from __future__ import annotations

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
from ._context import positional_arity
from ._context import rel_error


__all__ = ["adapt_layer_norm", "adapt_rms_norm", "match_layer_norm", "match_rms_norm"]

# Checked in this order; the first whose reference the module reproduces *bit for bit* wins, else the closest
# within tolerance. Bitwise first because in float32 both castings agree and llama's is the common one.
_RMS_CANDIDATES = (
    ("standard", 0.0, "llama"),
    ("standard", 0.0, "gemma"),
    ("offset", 1.0, "gemma"),
    ("offset", 1.0, "llama"),
)


def _hint(module: nn.Module) -> str:
    return str(getattr(type(module), "kernel_layer_name", "") or "")


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _looks_like_rms_norm(module: nn.Module) -> bool:
    if isinstance(module, nn.RMSNorm) or _hint(module) == "RMSNorm":
        return True
    return "rmsnorm" in type(module).__name__.lower()


def match_rms_norm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """RMSNorm in the standard (``w * x̂``) or offset (``(1 + w) * x̂``) form, with its casting order."""
    if not _looks_like_rms_norm(module):
        return None
    return ctx.verdict("rms_norm", module, lambda: _classify_rms_norm(module, ctx))


def _checked_norm(module: nn.Module, kind: str, allowed: frozenset[str]) -> tuple[torch.Tensor, float] | Decline:
    """(weight, eps) of a norm module whose structure a kernel can serve, or why not."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.Tensor):
        return Decline(kind, "has no weight parameter (scale-free norm); no kernel handles that form")
    if weight.dim() != 1 or not set(module._parameters) <= allowed:
        return Decline(kind, f"expected a 1-D weight (and {sorted(allowed - {'weight'}) or 'nothing'} else), found "
                             f"parameters {sorted(module._parameters)}")
    arity, star = positional_arity(type(module).forward)
    if arity != 1 or star:
        return Decline(kind, "forward takes more than the hidden states (e.g. a gate); left alone")
    eps = _eps(module)
    if eps is None:
        return Decline(kind, "no numeric epsilon attribute (variance_epsilon / eps)")
    if weight.device.type == "meta":
        return Decline(kind, "parameters are on the meta device; the math cannot be verified")
    placements = dtensor_placements(weight)
    if placements is not None:
        # FSDP2's shards are gathered before this point, so a DTensor here is tensor parallel's.
        return Decline(kind, f"weight is a DTensor {placements} (tensor parallel); the kernels take plain tensors")
    return weight, eps


def _classify_rms_norm(module: nn.Module, ctx: MatchContext) -> Match | Decline:
    checked = _checked_norm(module, "rms_norm", frozenset({"weight"}))
    if isinstance(checked, Decline):
        return checked
    real_weight, eps = checked
    forward = ctx.original_forward(module)
    dtype, device = real_weight.dtype, real_weight.device
    gen = ctx.generator(device)
    x = ctx.randn(2, 3, real_weight.numel(), device=device, dtype=dtype, gen=gen) * 3 + 0.5
    # A random weight, not the module's: freshly initialised norms hold ones (or zeros for (1 + w) forms), with
    # which the casting orders round identically and the probe could not tell them apart.
    weight = 1 + 0.5 * ctx.randn(real_weight.numel(), device=device, dtype=dtype, gen=gen)
    try:
        with ctx.parameters_as(module, {"weight": weight}):
            actual, actual_training = ctx.run_probe(module, forward, x)
    except Exception as exc:  # noqa: BLE001 - a module we cannot probe is left alone
        return Decline("rms_norm", f"probe forward raised {type(exc).__name__}: {exc}")
    if not isinstance(actual, torch.Tensor):
        return Decline("rms_norm", f"forward returns {type(actual).__name__}, not a tensor")
    if not (isinstance(actual_training, torch.Tensor) and torch.equal(actual, actual_training)):
        return Decline("rms_norm", "forward behaves differently in training (dropout or the like); left alone")
    ctx.note_probe(module, "rms_norm", (x,), {}, actual)
    verdict = _closest_rms_norm(x, weight, eps, actual, dtype)
    if verdict is None:
        return Decline("rms_norm", "probe output matches neither w*x̂ nor (1+w)*x̂ RMSNorm; math differs")
    err, variant, offset, casting = verdict
    if dtype in (torch.float32, torch.float64):
        # In full precision both casting orders give the same numbers, so the float32 probe cannot tell Llama's
        # (normalise, round, then scale) from Gemma's / OLMo-2's (scale in float32, then round); the difference
        # appears once the model runs in bfloat16 or float16. Probe that rounding too, with a half-precision
        # copy of the weight, so the kernel stays exact after ``model.to(torch.bfloat16)`` or under autocast.
        casting = _half_precision_casting(module, ctx, forward, x, weight, eps, variant) or casting
    how = "bit for bit" if err == 0.0 else f"(rel. error {err:.1e})"
    return Match("rms_norm", variant, {"eps": eps, "offset": offset, "casting": casting},
                 evidence=f"probe matches the {variant}/{casting} reference {how}")


def _closest_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, actual: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[float, str, float, str] | None:
    """(rel. error, variant, offset, casting) of the candidate reproducing ``actual``: bit for bit first."""
    best: tuple[float, str, float, str] | None = None
    with torch.no_grad():
        for variant, offset, casting in _RMS_CANDIDATES:
            expected = _reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)
            if expected.shape == actual.shape and expected.dtype == actual.dtype and torch.equal(actual, expected):
                return 0.0, variant, offset, casting
            if close(actual, expected, dtype):
                err = rel_error(actual, expected)
                if best is None or err < best[0]:
                    best = (err, variant, offset, casting)
    return best


def _half_precision_casting(module: nn.Module, ctx: MatchContext, forward: Callable[..., Any], x: torch.Tensor,
                            weight: torch.Tensor, eps: float, variant: str) -> str | None:
    half = torch.bfloat16
    x16, w16 = x.to(half), weight.detach().to(half)
    try:
        with ctx.parameters_as(module, {"weight": w16}), torch.no_grad():
            actual = forward(x16)
    except Exception:  # noqa: BLE001 - a module that only runs in full precision keeps its full-precision verdict
        return None
    if not isinstance(actual, torch.Tensor):
        return None
    verdict = _closest_rms_norm(x16, w16, eps, actual, half)
    return verdict[3] if verdict is not None and verdict[1] == variant else None


def _weight_source(module: nn.Module) -> dict[str, Any]:
    """Where ``module.weight`` can be read without ``nn.Module.__getattr__`` (a Python call costing about as much
    host time as the rest of a norm call's dispatch): the module's parameter dict, or an empty dict (read the
    attribute) where the class defines ``weight`` itself, e.g. as a property."""
    return {} if hasattr(type(module), "weight") else module._parameters


def adapt_rms_norm(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    eps, offset, casting = match.params["eps"], match.params["offset"], match.params["casting"]
    parameters = _weight_source(module)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # A weight replaced by a plain tensor (no longer a parameter) is found through the attribute.
        weight = parameters.get("weight")
        return impl(hidden_states, module.weight if weight is None else weight, eps=eps, offset=offset,
                    casting=casting)

    return forward


def match_layer_norm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """LayerNorm over the last dimension, with or without bias."""
    if not (isinstance(module, nn.LayerNorm) or "layernorm" in type(module).__name__.lower()
            or _hint(module) == "LayerNorm"):
        return None
    return ctx.verdict("layer_norm", module, lambda: _classify_layer_norm(module, ctx))


def _classify_layer_norm(module: nn.Module, ctx: MatchContext) -> Match | Decline:
    checked = _checked_norm(module, "layer_norm", frozenset({"weight", "bias"}))
    if isinstance(checked, Decline):
        return checked
    weight, eps = checked
    bias = module._parameters.get("bias")
    gen = ctx.generator(weight.device)
    x = ctx.randn(2, 3, weight.numel(), device=weight.device, dtype=weight.dtype, gen=gen) * 2 + 0.3
    try:
        outputs = ctx.run_probe(module, ctx.original_forward(module), x)
    except Exception as exc:  # noqa: BLE001
        return Decline("layer_norm", f"probe forward raised {type(exc).__name__}: {exc}")
    with torch.no_grad():
        expected = _reference.layer_norm(x, weight, bias, eps=eps)
    if not all(close(actual, expected, weight.dtype) for actual in outputs):
        return Decline("layer_norm", "probe output differs from layer_norm(x) over the last dim; math differs")
    ctx.note_probe(module, "layer_norm", (x,), {}, outputs[0])
    variant = "bias" if isinstance(bias, torch.Tensor) else "no_bias"
    return Match("layer_norm", variant, {"eps": eps}, evidence="probe matches F.layer_norm")


def adapt_layer_norm(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    eps = match.params["eps"]
    parameters = _weight_source(module)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = parameters.get("weight")
        return impl(hidden_states, module.weight if weight is None else weight, module._parameters.get("bias"),
                    eps=eps)

    return forward
