"""Pre-norm decoder layers: the residual add after attention and the RMSNorm after it, as one kernel.

transformers' Llama-style decoder layer (Llama, Mistral, Qwen2/3, Gemma, Mixtral, ...) computes::

    residual = h; h = input_layernorm(h); h, _ = self_attn(hidden_states=h, ...)
    h = residual + h; residual = h; h = post_attention_layernorm(h)     <- residual_rms_norm: one kernel
    h = mlp(h); h = residual + h

Variants compute the same add + norm, each verified the same way:

- residual multipliers (Granite, MiniCPM): ``h = residual + h * m`` after attention and after the MLP, ``m`` a
  number the layer holds; the kernel gets ``h * m`` (computed as the layer does) as its input;
- norms on the branches (sandwich: Gemma 2/3, GLM-4, AFMoE, HyperCLOVA X): ``h = residual + attention_norm(attn)``,
  then the fused norm (``pre_feedforward_layernorm`` in Gemma's naming, as VaultGemma names it without the
  sandwich), the MLP, the MLP's output norm, the residual add;
- dropout modules on the branches before their adds (Emu3, Phi-3), called as the layer calls them;
- shared experts added to the routed MLP's output (Granite-MoE-Shared), and an MLP returning (hidden states, router
  scores) of which the layer keeps the first (gpt-oss).

The matcher accepts a layer only if its class forward uses exactly the sub-modules (and multiplier) of one layout
and hands every argument on (checked in its code), and a probe of the layer's own forward, with real attention
inputs, equals the adapter running the reference math, in eval and in training behaviour. Post-norm layouts
(OLMo-2, EXAONE-4: no norm follows the residual add), parallel attention and MLP (Cohere), hyper-connections
(DeepSeek-V4), per-layer token mixers (Qwen3-Next) and the like are declined, the reason naming what the layer
does instead.

The adapter keeps the layer's own ``input_layernorm``, ``self_attn`` and ``mlp`` (their kernels still apply) and
hands only the residual add and the norm after it to the kernel; the match declares that norm bypassed,
so while the fused kernel is bound the norm gets no kernel of its own and the report shows it covered.
transformers 5 wraps the class forward in decorators (gradient checkpointing, renamed keywords); the adapter
re-creates them around the fused forward, so gradient checkpointing and old keyword names keep working.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._errors import KernelFallbackWarning
from .._forward import decorator_chain_problem
from .._forward import rewrap
from .._types import Decline
from .._types import Match
from . import _reference
from ._context import MatchContext
from ._context import close
from ._context import fsdp_module_type
from ._context import math_key
from ._context import param_dtype
from ._context import plain_class_forward
from ._context import rel_error
from ._linear import wrapped_module
from ._norms import match_rms_norm
from ._zero3 import HOOKS
from ._zero3 import MODULE
from ._zero3 import access
from ._zero3 import enter_forward
from ._zero3 import exit_forward
from ._zero3 import hooks_problem
from ._zero3 import is_partitioned
from ._zero3 import require_whole


__all__ = ["KIND", "adapt_residual_rms_norm", "match_residual_rms_norm"]

KIND = "residual_rms_norm"

# The attribute names the pre-norm template's forward uses, and nothing else (bytecode ``co_names``).
_TEMPLATE = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
# Gemma 2/3: a norm on each branch's output before its residual add, and the fused one before the MLP.


@dataclass(frozen=True)
class Layout:
    """Where the fused residual add + norm sits in a decoder layer.

    ``fused`` is the norm after the attention's residual add (the kernel's weight); ``attention_norm`` and
    ``mlp_norm`` are norms on the attention's and the MLP's output before their residual adds (sandwich); a
    ``multiplier`` attribute scales both branches before their residual adds (Granite); ``attention_dropout`` and
    ``mlp_dropout`` are dropout modules on each branch before its add (Emu3, Phi-3); ``input_norm`` is the norm
    before attention (``attention_layernorm`` in Apertus, whose fused one is ``feedforward_layernorm``);
    ``shared_mlp`` is a module whose output is added to the MLP's where the layer has one (Granite-MoE-Shared);
    ``mlp_tuple`` says that the MLP returns ``(hidden states, router scores)``, of which the layer keeps the first
    (gpt-oss).
    """

    fused: str = "post_attention_layernorm"
    input_norm: str = "input_layernorm"
    attention_norm: str | None = None
    mlp_norm: str | None = None
    multiplier: str | None = None
    mlp: str = "mlp"
    attention_dropout: str | None = None
    mlp_dropout: str | None = None
    shared_mlp: str | None = None
    mlp_tuple: bool = False

    def names(self) -> frozenset[str]:
        extra = {n for n in (self.attention_norm, self.mlp_norm, self.multiplier, self.attention_dropout,
                             self.mlp_dropout, self.shared_mlp) if n}
        return frozenset({self.input_norm, "self_attn", self.mlp, self.fused, *extra})


_STANDARD = Layout()
# (input_norm, fused, attention_norm, mlp_norm): the pre-norm template's norms, VaultGemma's fused one (named for the
# MLP it precedes), Apertus's names, and the sandwich layouts: Gemma 2/3, GLM-4, AFMoE, HyperCLOVA X's peri-layer
# norms.
_NORMS = (("input_layernorm", "post_attention_layernorm", None, None),
          ("input_layernorm", "pre_feedforward_layernorm", None, None),
          ("attention_layernorm", "feedforward_layernorm", None, None),
          ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
          ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"),
          ("input_layernorm", "pre_mlp_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
          ("input_layernorm", "post_attention_layernorm", "post_norm1", "post_norm2"))
# What families call the feed-forward block (an MoE one included): Llama, Granite-MoE / Mixtral of old, Llama 4.
_MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
# Dropout modules on the attention's and the MLP's branch before their residual adds: Emu3's one, Phi-3's two.
_DROPOUTS = ((None, None), ("dropout", "dropout"), ("resid_attn_dropout", "resid_mlp_dropout"))
_LAYOUTS = tuple(
    Layout(fused=f, input_norm=i, attention_norm=a, mlp_norm=n, mlp=m, attention_dropout=da, mlp_dropout=dm,
           shared_mlp=shared)
    for i, f, a, n in _NORMS for m in _MLP_NAMES for da, dm in _DROPOUTS for shared in (None, "shared_mlp"))
# The names a decoder layer's norms go by: a layer holding none of them is no candidate.
_NORM_NAMES = frozenset(name for names in _NORMS for name in names if name)


def _layout(module: nn.Module) -> Layout | None:
    """The layout whose names the layer's class forward uses exactly, if any, a numeric attribute of the layer
    (a residual multiplier) allowed besides (the probe then checks the math)."""
    names = frozenset(plain_class_forward(module).__code__.co_names)
    for layout in _LAYOUTS:
        base = layout.names()
        if names == base:
            return layout
        extra = names - base
        if len(extra) == 1 and base <= names:
            (name,) = extra
            value = getattr(module, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return dataclasses.replace(layout, multiplier=name)
    return None

# What a family using more or fewer names does instead, for the report.
_EXPLAINED = {
    "pre_feedforward_layernorm": "sandwich norms around the MLP (Gemma 2/3 style)",
    "post_feedforward_layernorm": "a norm after the MLP (post-norm, OLMo-2 / Gemma 2 style)",
    "post_self_attn_layernorm": "a norm after attention (GLM-4 style)",
    "post_mlp_layernorm": "a norm after the MLP (GLM-4 style)",
    "resid_attn_dropout": "dropout on the residual branch",
    "resid_mlp_dropout": "dropout on the residual branch",
    "resid_dropout": "dropout on the residual branch",
    "attn_hc": "hyper-connections: several residual streams mixed by learned maps around each branch, not one "
               "residual add",
    "block_type": "the token mixer is chosen per layer (linear attention or self-attention), called with other "
                  "arguments each",
    "linear_attn": "the token mixer is chosen per layer (linear attention or self-attention), called with other "
                   "arguments each",
    "attn_alpha_factor": "DeepNorm: the residual is the normed input times one factor, added to the branch times "
                         "another, and the norm's output becomes the next residual",
    "is_moe_layer": "the feed-forward output is unpacked on MoE layers and reshaped to the residual's shape",
    "mlps": "two attention and MLP sub-layers per layer, with a shortcut MLP's output added at the end",
    "use_flexible_linear": "per-codebook linear layers that take extra arguments",
    "input_residual": "the residual is multiplied by a learned vector before each add",
    "depth_scaled_residual_add": "a depth-scaled residual add, not residual + branch",
}

_PROBE_TOKENS = 5


def _loaded_locals(fn: Callable[..., Any]) -> set[str]:
    """Local names the function's bytecode reads (``LOAD_FAST`` and its variants)."""
    names: set[str] = set()
    for instruction in dis.get_instructions(fn):
        if instruction.opname.startswith("LOAD_FAST"):
            value = instruction.argval
            names.update(value if isinstance(value, tuple) else (value,))
    return names


@dataclass(frozen=True)
class _Arguments:
    """How the class forward takes its arguments: all of them are handed on to ``self_attn`` as keywords."""

    positional: tuple[str, ...]  # positional-or-keyword parameters after the hidden states
    defaults: tuple[tuple[str, Any], ...]  # their defaults, and those of keyword-only parameters


@functools.lru_cache(maxsize=256)
def _arguments(forward: Callable[..., Any]) -> _Arguments | str:
    """The forward's parameters, or why the fused forward cannot take them the same way (cached per class)."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    if not params or params[0].kind is not params[0].POSITIONAL_OR_KEYWORD:
        return "forward does not take the hidden states as its first argument"
    odd = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
    if odd:
        return f"forward takes positional-only or *args parameters {odd}"
    loaded = _loaded_locals(forward)
    unused = sorted(p.name for p in params if p.name not in loaded)
    if unused:
        return f"forward does not pass {unused} on (to self_attn); the fused forward would"
    rest = params[1:]
    positional = tuple(p.name for p in rest if p.kind is p.POSITIONAL_OR_KEYWORD)
    defaults = tuple((p.name, p.default) for p in rest
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty)
    return _Arguments(positional, defaults)


def _fused_forward(module: nn.Module, impl: Callable[..., Any], *, eps: float, offset: float,
                   casting: str, layout: Layout = _STANDARD) -> Callable[..., Any]:
    """The layer's forward with the residual add after attention and the norm after it done by ``impl``."""
    arguments = _arguments(plain_class_forward(module))
    if isinstance(arguments, str):
        raise TypeError(f"{type(module).__name__}: {arguments}")
    names, defaults = arguments.positional, dict(arguments.defaults)
    fused, attention_norm, input_norm, multiplier = layout.fused, layout.attention_norm, layout.input_norm, (
        layout.multiplier)
    attention_dropout = layout.attention_dropout
    # The kernel reads the fused norm's weight without calling it. A module put in the norm's place after
    # kernelize (an unknown wrapper, fully_shard of the norm alone) would be bypassed: then the layer runs its own
    # forward, checked at every call (a type test). PEFT's modules_to_save runs a trainable copy of the norm, whose
    # weight the kernel then reads. Hooks are judged at kernelize time only: DeepSpeed ZeRO-3 hooks every module.
    norm_type = type(module._modules[fused])
    plain = plain_class_forward(module)
    warned: list[str] = []  # for this binding

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = self._modules[fused]
        if type(norm) is not norm_type:
            norm = wrapped_module(norm) or norm
        if type(norm) is not norm_type:
            if not warned:
                warned.append(type(norm).__name__)
                warnings.warn(f"kernels-core: the fused residual add + RMSNorm of {type(self).__name__} falls back "
                              f"to the layer's own forward: its {fused} is now "
                              f"{type(norm).__name__} (replaced after kernelize), and the kernel would read its "
                              "weight without calling it", KernelFallbackWarning, stacklevel=2)
            return plain(self, hidden_states, *args, **kwargs)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(names) + 1} positional arguments "
                            f"but {len(args) + 1} were given")
        # The template hands every argument on to self_attn as a keyword, **kwargs included.
        attention_kwargs = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
        residual = hidden_states
        hidden_states = self._modules[input_norm](hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_kwargs)
        if attention_norm is not None:
            hidden_states = self._modules[attention_norm](hidden_states)
        if attention_dropout is not None:
            hidden_states = self._modules[attention_dropout](hidden_states)
        if multiplier is not None:
            # As the layer computes it (residual + h * m): the product rounded in the activations' dtype, then added.
            hidden_states = hidden_states * getattr(self, multiplier)
        normed, residual = _add_and_norm(norm, impl, hidden_states, residual, name=fused, eps=eps, offset=offset,
                                         casting=casting)
        return residual + _mlp_branch(self, layout, normed)

    # Decorators around the class forward (transformers 5 checkpoints activations inside one, and renames
    # deprecated keywords in another) are re-created around the fused forward, so what they do stays exact.
    return rewrap(type(module).forward, forward).__get__(module, type(module))


def _add_and_norm(norm: nn.Module, impl: Callable[..., Any], hidden_states: torch.Tensor, residual: torch.Tensor, *,
                  name: str, eps: float, offset: float, casting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(residual + hidden_states)`` and that sum, by the kernel where it can read the norm's weight."""
    # The kernel reads the norm's weight without calling the norm. Under DeepSpeed ZeRO-3 it runs between the
    # norm's own hooks, which gather the weight; where only calling the norm would gather it (hooks of another
    # origin too, or none), the norm module is called as the template does.
    weight = norm._parameters.get("weight")
    how = access(norm, weight)
    if how == MODULE:
        residual = residual + hidden_states
        return norm(residual), residual
    if weight is None:  # a weight replaced by a plain tensor is found through the attribute
        weight = norm.weight
    inputs: tuple[Any, ...] = (hidden_states,)
    if how == HOOKS:
        inputs = enter_forward(norm, inputs)
        require_whole(weight, f"{name}.weight")
    hidden_states, residual = impl(inputs[0], residual, weight, eps=eps, offset=offset, casting=casting)
    if how == HOOKS:
        hidden_states = exit_forward(norm, inputs, hidden_states)
    return hidden_states, residual


def _mlp_branch(layer: nn.Module, layout: Layout, normed: torch.Tensor) -> torch.Tensor:
    """The feed-forward branch after the fused norm, as the layer computes it, before its residual add."""
    hidden_states = layer._modules[layout.mlp](normed)
    if layout.mlp_tuple:
        hidden_states, _ = hidden_states
    shared = layer._modules.get(layout.shared_mlp) if layout.shared_mlp is not None else None
    if shared is not None:  # as the layer does: the shared experts' output added to the routed ones'
        hidden_states = hidden_states + shared(normed)
    if layout.mlp_norm is not None:
        hidden_states = layer._modules[layout.mlp_norm](hidden_states)
    if layout.mlp_dropout is not None:
        hidden_states = layer._modules[layout.mlp_dropout](hidden_states)
    if layout.multiplier is not None:
        hidden_states = hidden_states * getattr(layer, layout.multiplier)
    return hidden_states


def adapt_residual_rms_norm(module: nn.Module, match: Match, impl: Callable[..., Any],
                            options: dict) -> Callable[..., Any]:
    """The decoder layer's forward, calling ``impl(x, residual, weight, *, eps, offset, casting)`` for add + norm."""
    return _fused_forward(module, impl, eps=match.params["eps"], offset=match.params["offset"],
                          casting=match.params["casting"], layout=_layout_of(match))


def _layout_of(match: Match) -> Layout:
    layout = match.params.get("layout")
    return Layout(**dict(layout)) if layout else _STANDARD


def match_residual_rms_norm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Pre-norm decoder layers whose ``post_attention_layernorm`` is an RMSNorm, verified by a probe."""
    children = module._modules
    if not (isinstance(children.get("self_attn"), nn.Module)
            and any(isinstance(children.get(n), nn.Module) for n in _NORM_NAMES)):
        return None
    if getattr(plain_class_forward(module), "__code__", None) is None:
        return None
    return ctx.verdict(KIND, module, lambda: _classify(module, name, ctx))


def _structure_problem(module: nn.Module) -> str | None:
    forward = plain_class_forward(module)
    names = frozenset(forward.__code__.co_names)
    layout = _layout(module)
    if layout is None:
        extra, missing = sorted(names - _TEMPLATE), sorted(_TEMPLATE - names)
        why = sorted({_EXPLAINED[n] for n in extra if n in _EXPLAINED})
        parts = [f"also uses {extra}"] if extra else []
        if missing:
            parts.append(f"does not use {missing}")
        if "post_attention_layernorm" in missing and "mlp" not in missing:
            why.append("no norm between the residual add and the MLP (parallel attention and MLP?)")
        because = f" ({'; '.join(why)})" if why else ""
        if "post_feedforward_layernorm" in extra and "pre_feedforward_layernorm" not in names:
            why.append("no norm follows the attention's residual add (post-norm), so there is no add + norm to fuse")
            because = f" ({'; '.join(why)})"
        return (f"forward is not the pre-norm template (input_layernorm, self_attn, residual add [x a residual "
                f"multiplier], post_attention_layernorm, mlp, residual add) nor a variant of it the fused forward "
                f"re-creates (norms on the branches, dropout on the branches, shared experts): it "
                f"{' and '.join(parts)}{because}")
    for child in layout.names() - {layout.multiplier}:
        if not isinstance(module._modules.get(child), nn.Module) and not (child == layout.shared_mlp
                                                                            and module._modules.get(child) is None):
            return f"{child} is not a sub-module"
    wrapped = decorator_chain_problem(type(module).forward)
    if wrapped:
        return wrapped
    arguments = _arguments(forward)
    return arguments if isinstance(arguments, str) else None


def _offloads(hook: object) -> bool:
    """Whether an accelerate hook (or any in a ``SequentialHook``) loads the module's weights when it is called."""
    hooks = getattr(hook, "hooks", None) or (hook,)
    return any(bool(getattr(h, "offload", False)) for h in hooks)


def _norm_problem(norm: nn.Module, name: str = "post_attention_layernorm") -> str | None:
    """Why reading the norm's weight without calling the norm module could see something else than its forward."""
    if (norm._forward_hooks or norm._forward_pre_hooks) and hooks_problem(norm) is not None:
        # DeepSpeed ZeRO-3's parameter hooks are not bypassed: the adapter runs them around the kernel.
        return (f"{name} has forward hooks (adapters, activation capture?); the fused kernel reads "
                "its weight without calling it and would bypass them")
    # accelerate's device-placement hooks only move inputs, which the layer's own hook has done already; an
    # offloading one loads the weight at call time, which the fused kernel would never trigger.
    if "_hf_hook" in norm.__dict__ and _offloads(norm.__dict__["_hf_hook"]):
        return f"{name}'s weight is offloaded (loaded by its accelerate hook only when called)"
    fsdp_module = fsdp_module_type()
    if fsdp_module is not None and isinstance(norm, fsdp_module):
        return f"{name} is its own FSDP unit; its weight is gathered only when it is called"
    return None


def _classify(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline:
    problem = _structure_problem(module)
    if problem:
        return Decline(KIND, problem, unrecognized=True)
    layout = _layout(module) or _STANDARD
    fused = layout.fused
    norm = module._modules[fused]
    problem = _norm_problem(norm, fused)
    if problem:
        return Decline(KIND, problem)
    norm_verdict = match_rms_norm(norm, f"{name}.{fused}", ctx)
    if norm_verdict is None:
        return Decline(KIND, f"{fused} is {type(norm).__name__}, not an RMSNorm")
    if isinstance(norm_verdict, Decline):
        return Decline(KIND, f"{fused}: {norm_verdict.reason}")
    params = {key: norm_verdict.params[key] for key in ("eps", "offset", "casting")}
    weight = norm.weight
    dtype = param_dtype(module) or weight.dtype
    if weight.device.type == "meta":
        return Decline(KIND, "parameters are on the meta device; the math cannot be verified")
    # Layers differing only in their sub-modules' layer_idx (a KV-cache slot, unused by the probe) share one probe.
    key = _probe_key(module)
    if key not in ctx.memo:
        ctx.memo[key] = _probe(module, ctx.original_forward(module), ctx, norm_verdict.variant, params, weight.device,
                               dtype, weight.numel(), layout)
    return ctx.memo[key]


def _probe_key(module: nn.Module) -> tuple[object, ...]:
    """The layer's math key without ``layer_idx``: the probe compares two forwards over the same sub-modules, so
    what a sub-module does with its index (which KV-cache slot it fills) is the same in both."""
    parts: list[object] = []
    for part in math_key(module):
        if isinstance(part, tuple) and len(part) == 4 and isinstance(part[2], tuple):
            scalars = tuple(p for p in part[2] if not (isinstance(p, tuple) and p[:1] == ("layer_idx",)))
            part = (*part[:2], scalars, part[3])
        parts.append(part)
    return (KIND, "probe", tuple(parts))


def _probe_kwargs(module: nn.Module, ctx: MatchContext, x: torch.Tensor, gen: torch.Generator) -> dict[str, Any]:
    """The arguments a transformers decoder layer gets from its model, for a causal batch without padding."""
    params = inspect.signature(plain_class_forward(module)).parameters
    device, dtype = x.device, x.dtype
    position_ids = torch.arange(_PROBE_TOKENS, device=device)[None]
    kwargs: dict[str, Any] = {}
    if "attention_mask" in params:
        kwargs["attention_mask"] = None  # causal attention without padding
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if "position_embeddings" not in params:
        return kwargs
    embeddings = ctx.position_embeddings(x, position_ids) or _single_tensor_embeddings(ctx, x, position_ids)
    if embeddings is None:
        # No usable rotary module (a bare layer, say): rotate-half cos/sin over the model's rotary dims.
        dims = ctx.rotary_dims()
        head_dim = getattr(module.self_attn, "head_dim", None)
        if len(dims) == 1:
            rotary = next(iter(dims))
        elif head_dim in dims or not dims:
            rotary = head_dim
        else:  # several sizes (per attention type): any one the attention accepts serves the comparison
            rotary = max(dims)
        if isinstance(rotary, int) and rotary > 0:
            angles = ctx.randn(1, _PROBE_TOKENS, rotary // 2, device=device, dtype=torch.float32, gen=gen) * 3
            emb = torch.cat((angles, angles), dim=-1)
            embeddings = (emb.cos().to(dtype), emb.sin().to(dtype))
    if embeddings is not None:
        kwargs["position_embeddings"] = embeddings
    return kwargs


def _single_tensor_embeddings(ctx: MatchContext, x: torch.Tensor, position_ids: torch.Tensor
                              ) -> torch.Tensor | None:
    """What a rotary module returning one tensor gives the layers (DeepSeek-V2's complex ``freqs_cis``), if any."""
    for rotary in ctx.rotary_modules():
        try:
            with torch.no_grad():
                out = rotary(x, position_ids)
        except Exception:  # noqa: BLE001 - another signature: the caller synthesises cos/sin
            continue
        if isinstance(out, torch.Tensor):
            return out
    return None


def _causal_mask(x: torch.Tensor) -> torch.Tensor:
    """The additive ``[B, 1, S, S]`` causal mask (0 where a query sees a key, the dtype's minimum elsewhere): the same
    attention as no mask with a causal flag, for layers that read the mask themselves (DeepSeek-V3.2's indexer)."""
    batch, tokens = x.shape[0], x.shape[1]
    blocked = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).triu(1)
    mask = torch.zeros(tokens, tokens, dtype=x.dtype, device=x.device).masked_fill(blocked, torch.finfo(x.dtype).min)
    return mask.expand(batch, 1, tokens, tokens)


def _probe(module: nn.Module, original: Callable[..., Any], ctx: MatchContext, variant: str, params: dict[str, Any],
           device: torch.device, dtype: torch.dtype, hidden: int, layout: Layout = _STANDARD) -> Match | Decline:
    gen = ctx.generator(device)
    x = ctx.randn(2, _PROBE_TOKENS, hidden, device=device, dtype=dtype, gen=gen)
    kwargs = _probe_kwargs(module, ctx, x, gen)
    template = _fused_forward(module, _reference.residual_rms_norm, **params, layout=layout)

    # run_probe draws each run's randomness from a generator of its own, seeded alike, so the layer's forward and
    # the template see the same dropout masks (attention dropout is the layer's math) without seeding torch's
    # process-wide generator, which another thread may be training with.
    def run(fn: Callable[..., Any]) -> list[Any]:
        return ctx.run_probe(module, lambda: fn(x, **kwargs))

    try:
        actual = run(original)
    except Exception as exc:  # noqa: BLE001 - a layer we cannot probe is left alone
        if "attention_mask" not in kwargs:
            return Decline(KIND, f"probe forward raised {type(exc).__name__}: {exc}")
        # Some attentions read the mask themselves and need it spelled out (DeepSeek-V3.2's sparse-attention
        # indexer): the same causal attention, as a 4-D additive mask.
        kwargs["attention_mask"] = _causal_mask(x)
        try:
            actual = run(original)
        except Exception as exc_with_mask:  # noqa: BLE001
            return Decline(KIND, f"probe forward raised {type(exc).__name__}: {exc} (with a 4-D causal mask: "
                                 f"{type(exc_with_mask).__name__}: {exc_with_mask})")
    if not all(isinstance(out, torch.Tensor) for out in actual):
        return Decline(KIND, f"forward returns {type(actual[0]).__name__}, not the hidden states tensor")
    ctx.note_probe(module, KIND, (x,), kwargs, actual[0])
    try:
        expected = run(template)
    except Exception as exc:  # noqa: BLE001
        # An MLP returning (hidden states, router scores), which the layer unpacks (gpt-oss): the same names, so
        # only running it tells; the comparison below still decides.
        layout = dataclasses.replace(layout, mlp_tuple=True)
        try:
            expected = run(_fused_forward(module, _reference.residual_rms_norm, **params, layout=layout))
        except Exception:  # noqa: BLE001
            return Decline(KIND, f"the pre-norm template raised {type(exc).__name__} on this layer ({exc}), also "
                                 "taking the first of a tuple the MLP returns; its sub-modules do not behave like "
                                 "Llama's")
    if not all(close(a, e, dtype) for a, e in zip(actual, expected, strict=True)):
        if not all(close(a, e, dtype) for a, e in zip(run(original), actual, strict=True)):
            return Decline(KIND, "two probes of the layer's own forward differ: it draws random numbers the probe's "
                                 "generator does not reach (a fused dropout kernel?), so its math cannot be compared")
        err = max((rel_error(a, e) if a.shape == e.shape else float("inf")) for a, e in zip(actual, expected,
                                                                                           strict=True))
        return Decline(KIND, f"probe output differs from the pre-norm template with a fused residual add + "
                             f"RMSNorm in eval or training behaviour (rel. error {err:.1e}); math differs")
    casting = params["casting"]
    shape = ("a sandwich of norms" if layout.attention_norm else "the pre-norm decoder template") + (
        f" with residual multiplier {layout.multiplier}" if layout.multiplier else "") + (
        f" with dropout on the residual branches ({layout.attention_dropout}, {layout.mlp_dropout})"
        if layout.attention_dropout else "") + (
        f" ({layout.mlp} as the MLP{f' plus {layout.shared_mlp}' if layout.shared_mlp else ''}"
        f"{', the first of the tuple it returns' if layout.mlp_tuple else ''})"
        if (layout.mlp, layout.shared_mlp, layout.mlp_tuple) != ("mlp", None, False) else "")
    evidence = (f"forward is {shape} and a probe of the layer matches it with the fused {variant}/{casting} "
                f"residual add + RMSNorm ({layout.fused})")
    if is_partitioned(module._modules[layout.fused].weight):
        evidence += (f"; {layout.fused}'s weight is DeepSpeed ZeRO-3 partitioned: the kernel runs between "
                     "the norm's own DeepSpeed hooks, which gather it for the forward and the backward")
    if layout != _STANDARD:
        params = {**params, "layout": tuple(sorted(dataclasses.asdict(layout).items()))}
    return Match(KIND, variant, params, evidence=evidence, bypasses=(layout.fused,))
