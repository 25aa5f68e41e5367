"""Pre-norm decoder layers: the residual add after attention and the RMSNorm after it, as one kernel.

transformers' Llama-style decoder layer (Llama, Mistral, Qwen2/3, Gemma, Mixtral, ...) computes::

    residual = h; h = input_layernorm(h); h, _ = self_attn(hidden_states=h, ...)
    h = residual + h; residual = h; h = post_attention_layernorm(h)     <- residual_rms_norm: one kernel
    h = mlp(h); h = residual + h

The matcher accepts a layer only if its class forward uses exactly those four sub-modules and hands every argument
on (checked in its code), and a probe of the layer's own forward, with real attention inputs, equals the adapter
running the reference math, in eval and in training behaviour. Post-norm and sandwich layouts (OLMo-2, Gemma 2/3,
GLM-4), parallel attention and MLP (Cohere, Phi), residual multipliers (Granite) and residual dropout (Phi-3) use
other sub-modules or attributes and are declined with the reason.

The adapter keeps the layer's own ``input_layernorm``, ``self_attn`` and ``mlp`` (their kernels still apply) and
hands only the residual add and ``post_attention_layernorm`` to the kernel; the match declares that norm bypassed,
so while the fused kernel is bound the norm gets no kernel of its own and the report shows it covered.
transformers 5 wraps the class forward in decorators (gradient checkpointing, renamed keywords); the adapter
re-creates them around the fused forward, so gradient checkpointing and old keyword names keep working.
"""

from __future__ import annotations

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

# What a family using more or fewer names does instead, for the report.
_EXPLAINED = {
    "pre_feedforward_layernorm": "sandwich norms around the MLP (Gemma 2/3 style)",
    "post_feedforward_layernorm": "a norm after the MLP (post-norm, OLMo-2 / Gemma 2 style)",
    "post_self_attn_layernorm": "a norm after attention (GLM-4 style)",
    "post_mlp_layernorm": "a norm after the MLP (GLM-4 style)",
    "residual_multiplier": "a residual multiplier (Granite style)",
    "resid_attn_dropout": "dropout on the residual branch",
    "resid_mlp_dropout": "dropout on the residual branch",
    "resid_dropout": "dropout on the residual branch",
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
                   casting: str) -> Callable[..., Any]:
    """The layer's forward with the residual add and ``post_attention_layernorm`` done by ``impl``."""
    arguments = _arguments(plain_class_forward(module))
    if isinstance(arguments, str):
        raise TypeError(f"{type(module).__name__}: {arguments}")
    names, defaults = arguments.positional, dict(arguments.defaults)
    # The kernel reads post_attention_layernorm's weight without calling it. A module put in the norm's place after
    # kernelize (an unknown wrapper, fully_shard of the norm alone) would be bypassed: then the layer runs its own
    # forward, checked at every call (a type test). PEFT's modules_to_save runs a trainable copy of the norm, whose
    # weight the kernel then reads. Hooks are judged at kernelize time only: DeepSpeed ZeRO-3 hooks every module.
    norm_type = type(module.post_attention_layernorm)
    plain = plain_class_forward(module)
    warned: list[str] = []  # for this binding

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = self.post_attention_layernorm
        if type(norm) is not norm_type:
            norm = wrapped_module(norm) or norm
        if type(norm) is not norm_type:
            if not warned:
                warned.append(type(norm).__name__)
                warnings.warn(f"kernels-core: the fused residual add + RMSNorm of {type(self).__name__} falls back "
                              f"to the layer's own forward: its post_attention_layernorm is now "
                              f"{type(norm).__name__} (replaced after kernelize), and the kernel would read its "
                              "weight without calling it", KernelFallbackWarning, stacklevel=2)
            return plain(self, hidden_states, *args, **kwargs)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes {len(names) + 1} positional arguments "
                            f"but {len(args) + 1} were given")
        # The template hands every argument on to self_attn as a keyword, **kwargs included.
        attention_kwargs = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attention_kwargs)
        # The kernel reads the norm's weight without calling the norm. Under DeepSpeed ZeRO-3 it runs between the
        # norm's own hooks, which gather the weight; where only calling the norm would gather it (hooks of another
        # origin too, or none), the norm module is called as the template does.
        weight = norm._parameters.get("weight")
        how = access(norm, weight)
        if how == MODULE:
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = norm(hidden_states)
        else:
            if weight is None:  # a weight replaced by a plain tensor is found through the attribute
                weight = norm.weight
            inputs: tuple[Any, ...] = (hidden_states,)
            if how == HOOKS:
                inputs = enter_forward(norm, inputs)
                require_whole(weight, "post_attention_layernorm.weight")
            hidden_states, residual = impl(inputs[0], residual, weight, eps=eps, offset=offset, casting=casting)
            if how == HOOKS:
                hidden_states = exit_forward(norm, inputs, hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    # Decorators around the class forward (transformers 5 checkpoints activations inside one, and renames
    # deprecated keywords in another) are re-created around the fused forward, so what they do stays exact.
    return rewrap(type(module).forward, forward).__get__(module, type(module))


def adapt_residual_rms_norm(module: nn.Module, match: Match, impl: Callable[..., Any],
                            options: dict) -> Callable[..., Any]:
    """The decoder layer's forward, calling ``impl(x, residual, weight, *, eps, offset, casting)`` for add + norm."""
    return _fused_forward(module, impl, eps=match.params["eps"], offset=match.params["offset"],
                          casting=match.params["casting"])


def match_residual_rms_norm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Pre-norm decoder layers whose ``post_attention_layernorm`` is an RMSNorm, verified by a probe."""
    children = module._modules
    if not (isinstance(children.get("self_attn"), nn.Module)
            and any(isinstance(children.get(n), nn.Module) for n in ("input_layernorm", "post_attention_layernorm"))):
        return None
    if getattr(plain_class_forward(module), "__code__", None) is None:
        return None
    return ctx.verdict(KIND, module, lambda: _classify(module, name, ctx))


def _structure_problem(module: nn.Module) -> str | None:
    forward = plain_class_forward(module)
    names = frozenset(forward.__code__.co_names)
    if names != _TEMPLATE:
        extra, missing = sorted(names - _TEMPLATE), sorted(_TEMPLATE - names)
        why = sorted({_EXPLAINED[n] for n in extra if n in _EXPLAINED})
        parts = [f"also uses {extra}"] if extra else []
        if missing:
            parts.append(f"does not use {missing}")
        if "post_attention_layernorm" in missing and "mlp" not in missing:
            why.append("no norm between the residual add and the MLP (parallel attention and MLP?)")
        because = f" ({'; '.join(why)})" if why else ""
        return (f"forward is not the pre-norm template (input_layernorm, self_attn, residual add, "
                f"post_attention_layernorm, mlp, residual add): it {' and '.join(parts)}{because}")
    for child in _TEMPLATE:
        if not isinstance(module._modules.get(child), nn.Module):
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


def _norm_problem(norm: nn.Module) -> str | None:
    """Why reading the norm's weight without calling the norm module could see something else than its forward."""
    if (norm._forward_hooks or norm._forward_pre_hooks) and hooks_problem(norm) is not None:
        # DeepSpeed ZeRO-3's parameter hooks are not bypassed: the adapter runs them around the kernel.
        return ("post_attention_layernorm has forward hooks (adapters, activation capture?); the fused kernel reads "
                "its weight without calling it and would bypass them")
    # accelerate's device-placement hooks only move inputs, which the layer's own hook has done already; an
    # offloading one loads the weight at call time, which the fused kernel would never trigger.
    if "_hf_hook" in norm.__dict__ and _offloads(norm.__dict__["_hf_hook"]):
        return "post_attention_layernorm's weight is offloaded (loaded by its accelerate hook only when called)"
    fsdp_module = fsdp_module_type()
    if fsdp_module is not None and isinstance(norm, fsdp_module):
        return "post_attention_layernorm is its own FSDP unit; its weight is gathered only when it is called"
    return None


def _classify(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline:
    problem = _structure_problem(module)
    if problem:
        return Decline(KIND, problem, unrecognized=True)
    norm = module.post_attention_layernorm
    problem = _norm_problem(norm)
    if problem:
        return Decline(KIND, problem)
    norm_verdict = match_rms_norm(norm, f"{name}.post_attention_layernorm", ctx)
    if norm_verdict is None:
        return Decline(KIND, f"post_attention_layernorm is {type(norm).__name__}, not an RMSNorm")
    if isinstance(norm_verdict, Decline):
        return Decline(KIND, f"post_attention_layernorm: {norm_verdict.reason}")
    params = {key: norm_verdict.params[key] for key in ("eps", "offset", "casting")}
    weight = norm.weight
    dtype = param_dtype(module) or weight.dtype
    if weight.device.type == "meta":
        return Decline(KIND, "parameters are on the meta device; the math cannot be verified")
    # Layers differing only in their sub-modules' layer_idx (a KV-cache slot, unused by the probe) share one probe.
    key = _probe_key(module)
    if key not in ctx.memo:
        ctx.memo[key] = _probe(module, ctx.original_forward(module), ctx, norm_verdict.variant, params, weight.device,
                               dtype, weight.numel())
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
    embeddings = ctx.position_embeddings(x, position_ids)
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


def _probe(module: nn.Module, original: Callable[..., Any], ctx: MatchContext, variant: str, params: dict[str, Any],
           device: torch.device, dtype: torch.dtype, hidden: int) -> Match | Decline:
    gen = ctx.generator(device)
    x = ctx.randn(2, _PROBE_TOKENS, hidden, device=device, dtype=dtype, gen=gen)
    kwargs = _probe_kwargs(module, ctx, x, gen)
    template = _fused_forward(module, _reference.residual_rms_norm, **params)

    # run_probe draws each run's randomness from a generator of its own, seeded alike, so the layer's forward and
    # the template see the same dropout masks (attention dropout is the layer's math) without seeding torch's
    # process-wide generator, which another thread may be training with.
    def run(fn: Callable[..., Any]) -> list[Any]:
        return ctx.run_probe(module, lambda: fn(x, **kwargs))

    try:
        actual = run(original)
    except Exception as exc:  # noqa: BLE001 - a layer we cannot probe is left alone
        return Decline(KIND, f"probe forward raised {type(exc).__name__}: {exc}")
    if not all(isinstance(out, torch.Tensor) for out in actual):
        return Decline(KIND, f"forward returns {type(actual[0]).__name__}, not the hidden states tensor")
    ctx.note_probe(module, KIND, (x,), kwargs, actual[0])
    try:
        expected = run(template)
    except Exception as exc:  # noqa: BLE001
        return Decline(KIND, f"the pre-norm template raised {type(exc).__name__} on this layer ({exc}); its "
                             "sub-modules do not behave like Llama's (an MLP returning a tuple?)")
    if not all(close(a, e, dtype) for a, e in zip(actual, expected, strict=True)):
        if not all(close(a, e, dtype) for a, e in zip(run(original), actual, strict=True)):
            return Decline(KIND, "two probes of the layer's own forward differ: it draws random numbers the probe's "
                                 "generator does not reach (a fused dropout kernel?), so its math cannot be compared")
        err = max((rel_error(a, e) if a.shape == e.shape else float("inf")) for a, e in zip(actual, expected,
                                                                                           strict=True))
        return Decline(KIND, f"probe output differs from the pre-norm template with a fused residual add + "
                             f"RMSNorm in eval or training behaviour (rel. error {err:.1e}); math differs")
    casting = params["casting"]
    evidence = (f"forward is the pre-norm decoder template and a probe of the layer matches it with the fused "
                f"{variant}/{casting} residual add + RMSNorm")
    if is_partitioned(module.post_attention_layernorm.weight):
        evidence += ("; post_attention_layernorm's weight is DeepSpeed ZeRO-3 partitioned: the kernel runs between "
                     "the norm's own DeepSpeed hooks, which gather it for the forward and the backward")
    return Match(KIND, variant, params, evidence=evidence, bypasses=("post_attention_layernorm",))
