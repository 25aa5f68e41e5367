"""Gated MLPs, ``down(act(gate(x)) * up(x))``: SiLU (SwiGLU) and tanh-GELU (GeGLU).

The adapter keeps the module's own projection sub-modules (so LoRA, quantized or sharded linears keep working)
and hands only the activation-times-up product to the kernel; an activation sub-module is declared bypassed.

In training the product is not kept for backward. ``down_proj``'s weight gradient needs it, and eagerly autograd
keeps it beside the gate and up it was computed from (which the activation's own backward needs): one more
``[tokens, intermediate]`` tensor a layer, 117 MB at the Llama-3.1-8B shape and 4,096 tokens, a fifth of what a
decoder layer keeps there. Saved-tensor hooks around ``down_proj``'s call keep, for any tensor it saves that is the
product or a view of it, only that view's geometry; its backward gets the product back from the kernel run again on
the same gate and up, one elementwise pass, before the kernel's own backward may reuse their storage. The values
are the same, so the gradients are the same bit for bit (``test_mlp_recompute.py``). Whatever ``down_proj`` is (a
plain, LoRA, quantized or FSDP2-sharded linear) this holds; a copy it makes first (autocast's cast) is kept as
usual. Not under a torch.compile trace (the compiler decides what it keeps) nor where saved-tensor hooks are already
active (non-reentrant activation checkpointing keeps nothing anyway). Option ``recompute_product = false`` keeps
the product.
"""

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
from ._context import large_activation
from ._context import param_dtype
from ._context import positional_arity
from ._context import rel_error


__all__ = ["adapt_gated_mlp", "match_gelu_gated_mlp", "match_silu_gated_mlp"]

_KIND_FOR_ACTIVATION = {"silu": "silu_gated_mlp", "gelu_tanh": "gelu_gated_mlp"}


def _layout(module: nn.Module) -> str | None:
    children = module._modules
    if all(isinstance(children.get(n), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")):
        return "split"
    if all(isinstance(children.get(n), nn.Module) for n in ("gate_up_proj", "down_proj")):
        return "fused"
    return None


_ACTIVATION_ATTRS = ("act_fn", "activation_fn", "act")


def _activation_module(module: nn.Module) -> object | None:
    for attr in _ACTIVATION_ATTRS:
        act = getattr(module, attr, None)
        if act is not None:
            return act
    return None


def _activation_child(module: nn.Module) -> tuple[str, ...]:
    """The activation, if it is a sub-module: the kernel computes it and never calls it (the projections it does)."""
    for attr in _ACTIVATION_ATTRS:
        if getattr(module, attr, None) is not None:
            return (attr,) if isinstance(module._modules.get(attr), nn.Module) else ()
    return ()


def _gate_up(module: nn.Module, layout: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "split":
        return module.gate_proj(x), module.up_proj(x)
    gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    return gate, up


def _classify(module: nn.Module, ctx: MatchContext) -> tuple[str, Match | Decline] | None:
    """(kind, verdict) for a module shaped like a gated MLP, else None."""
    layout = _layout(module)
    if layout is None:
        return None
    arity, star = positional_arity(type(module).forward)
    if arity != 1 or star:
        return ("silu_gated_mlp", Decline("silu_gated_mlp", "forward takes more than the hidden states"))
    weight = next(module.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return ("silu_gated_mlp", Decline("silu_gated_mlp", "parameters are on the meta device; cannot verify"))
    act = _activation_module(module)
    if act is None:
        # No activation attribute: the forward applies it inline (F.silu in remote code) or is another library's
        # (Liger-Kernel's LigerSwiGLUMLP). The probe below decides which activation, if any, its output has.
        candidates: tuple[str, ...] = tuple(_KIND_FOR_ACTIVATION)
    else:
        activation = _reference.identify_activation(act, device=weight.device)
        if activation not in _KIND_FOR_ACTIVATION:
            what = activation or "unrecognised"
            return ("silu_gated_mlp",
                    Decline("silu_gated_mlp", f"gated MLP whose activation is {what}, not SiLU or tanh-GELU"))
        candidates = (activation,)
    kind = _KIND_FOR_ACTIVATION[candidates[0]]
    in_features = module.down_proj.out_features if isinstance(module.down_proj, nn.Linear) else None
    in_features = getattr(module.gate_proj if layout == "split" else module.gate_up_proj, "in_features", in_features)
    if not isinstance(in_features, int):
        return (kind, Decline(kind, "projection input size unknown (not nn.Linear-like)"))
    # The activations' dtype: a 4-bit linear's packed weight may be stored as uint8 (bitsandbytes' default).
    dtype = param_dtype(module) or torch.float32
    gen = ctx.generator(weight.device)
    x = ctx.randn(1, 3, in_features, device=weight.device, dtype=dtype, gen=gen)

    def reference_for(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def reference(x: torch.Tensor) -> torch.Tensor:
            gate, up = _gate_up(module, layout, x)
            return module.down_proj(_reference.gated_activation(gate, up, activation=activation))

        return reference

    try:
        # The projections run in both (the adapter calls them): dropout inside them (PEFT LoRA) draws the same
        # masks in the same order: run_probe gives each run its own generator, seeded alike.
        outputs = ctx.run_probe(module, ctx.original_forward(module), x)
        references_of = {name: reference_for(name) for name in candidates}
        probed = {name: ctx.run_probe(module, fn, x) for name, fn in references_of.items()}
    except Exception as exc:  # noqa: BLE001 - a module we cannot probe is left alone
        return (kind, Decline(kind, f"probe forward raised {type(exc).__name__}: {exc}"))
    if not bool(probed[candidates[0]][0].abs().max() > 0):
        return (kind, Decline(kind, "probe is inconclusive: the output is all zeros with these weights"))
    errors: dict[str, float] = {}
    for name, references in probed.items():
        if all(close(actual, ref, dtype) for actual, ref in zip(outputs, references, strict=True)):
            activation, kind, reference = name, _KIND_FOR_ACTIVATION[name], references_of[name]
            break
        errors[name] = max((rel_error(a, ref) if isinstance(a, torch.Tensor) and a.shape == ref.shape
                            else float("inf")) for a, ref in zip(outputs, references, strict=True))
    else:
        if len(errors) == 1:
            ((name, err),) = errors.items()
            return (kind, Decline(kind, f"probe output differs from down({name}(gate)*up) in eval or training "
                                        f"behaviour (rel. error {err:.1e}); math differs (multipliers, dropout, "
                                        "extra terms?)"))
        tried = " nor ".join(f"down({name}(gate)*up) (rel. error {err:.1e})" for name, err in errors.items())
        return (kind, Decline(kind, f"probe output matches neither {tried} in eval or training behaviour; the "
                                    "module names no activation attribute, so each known one was tried"))
    # Random unit rows never reach an activation bound (DeepSeek-V4's SwiGLU limit clamps gate and up at 10): the
    # same rows scaled until the largest pre-activation is large_activation() must give the reference math too.
    with torch.no_grad():
        peak = max(t.abs().max() for t in _gate_up(module, layout, x)).float()
    if bool(peak > 0):
        target = large_activation(dtype)
        large = (x.float() * (target / peak)).to(dtype)
        try:
            outputs_large = ctx.run_probe(module, ctx.original_forward(module), large)
            references_large = ctx.run_probe(module, reference, large)
        except Exception as exc:  # noqa: BLE001
            return (kind, Decline(kind, f"probe forward raised {type(exc).__name__} on large inputs: {exc}"))
        if all(bool(torch.isfinite(ref).all()) for ref in references_large) and not all(
                close(actual, ref, dtype) for actual, ref in zip(outputs_large, references_large, strict=True)):
            err = max((rel_error(a, ref) if isinstance(a, torch.Tensor) and a.shape == ref.shape
                       else float("inf")) for a, ref in zip(outputs_large, references_large, strict=True))
            return (kind, Decline(kind, f"probe output differs from down({activation}(gate)*up) at large "
                                        f"pre-activations (up to {target:g}; rel. error {err:.1e}), though not at "
                                        "small ones: the module bounds its activations (a clamp, as DeepSeek-V4's "
                                        "swiglu_limit), which the kernel does not"))
    ctx.note_probe(module, kind, (x,), {}, outputs[0])
    return (kind, Match(kind, layout, {"layout": layout, "activation": activation},
                        evidence=f"probe matches down({activation}(gate)*up), {layout} projections",
                        bypasses=_activation_child(module)))


def _classify_once(module: nn.Module, ctx: MatchContext) -> tuple[str, Match | Decline] | None:
    # Both gated-MLP kinds classify the same modules: one probe serves both.
    return ctx.verdict("gated_mlp", module, lambda: _classify(module, ctx))


def match_silu_gated_mlp(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """SwiGLU MLPs; also reports gated MLPs whose activation no core kind covers."""
    verdict = _classify_once(module, ctx)
    return verdict[1] if verdict and verdict[0] == "silu_gated_mlp" else None


def match_gelu_gated_mlp(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    verdict = _classify_once(module, ctx)
    return verdict[1] if verdict and verdict[0] == "gelu_gated_mlp" else None


class _RecomputedProduct:
    """What autograd keeps in place of ``act(gate) * up`` (or a view of it) that ``down_proj`` saves for backward:
    the view's geometry. The gate and up it is recomputed from are the ones the kernel saved for its own backward;
    holding them here keeps nothing alive that would not be."""

    __slots__ = ("offset", "size", "stride")

    def __init__(self, t: torch.Tensor, base_offset: int) -> None:
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - base_offset


def _recompute_hooks(impl: Callable[..., Any], gate: torch.Tensor, up: torch.Tensor, product: torch.Tensor
                     ) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """Saved-tensor hooks for ``down_proj``'s forward: its saved product is packed as its geometry alone, and
    unpacked (in backward, before the kernel's own backward may write gradients into gate and up) by running the
    kernel again on the same operands."""
    # Facts only: the pack hook must not hold the product itself.
    storage, base = product.untyped_storage().data_ptr(), product.storage_offset()
    device, dtype = product.device, product.dtype
    versions = (gate._version, up._version)

    def pack(t: torch.Tensor) -> Any:
        # Plain tensors only: a subclass (DTensor under tensor parallelism) may have no storage to compare, and
        # is what autograd must keep as it is.
        if (type(t) is torch.Tensor and t.layout == torch.strided and t.device == device and t.dtype == dtype
                and t.untyped_storage().data_ptr() == storage):
            return _RecomputedProduct(t, base)
        return t

    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _RecomputedProduct):
            return packed
        if (gate._version, up._version) != versions:
            raise RuntimeError("act(gate) * up cannot be recomputed for down_proj's backward: gate or up was "
                               "modified in place after the forward (a second backward through the same graph "
                               "after the kernel wrote its gradients there?)")
        with torch.no_grad():
            fresh = impl(gate, up)
        return fresh.as_strided(packed.size, packed.stride, fresh.storage_offset() + packed.offset)

    return pack, unpack


def _top_saved_tensors_hooks() -> object:
    # Whether saved-tensor hooks are already active (non-reentrant activation checkpointing, CPU offloading): they
    # decide what is kept, and hooks pushed over them would hide down_proj's tensors from them. Only torch's
    # private accessor tells; without it, assume they are.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False)


def _recomputable(gate: torch.Tensor, up: torch.Tensor, product: torch.Tensor) -> bool:
    """Whether down_proj's saved product can be recomputed in this call: autograd records it, the product is a
    plain dense tensor (not a subclass such as DTensor), and nothing else (a trace, other saved-tensor hooks)
    manages what is kept."""
    return (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad) and type(product) is torch.Tensor
            and product.layout == torch.strided and product.is_contiguous()
            and not torch.compiler.is_compiling() and _top_saved_tensors_hooks() is None)


def adapt_gated_mlp(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    layout = match.params["layout"]
    recompute = bool(options.get("recompute_product", True))

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = _gate_up(module, layout, x)
        product = impl(gate, up)
        if not (recompute and _recomputable(gate, up, product)):
            return module.down_proj(product)
        with torch.autograd.graph.saved_tensors_hooks(*_recompute_hooks(impl, gate, up, product)):
            return module.down_proj(product)

    return forward
