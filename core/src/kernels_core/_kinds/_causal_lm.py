"""Causal-LM loss: a ``*ForCausalLM`` forward that, in training, never materialises the logits.

Only kernelize for ``Mode.TRAINING`` binds it: in inference the forward must return logits, so the kernel would
never run, and the module is declined with that reason.

A whole-model probe would be too costly, so the matcher checks the forward's *code* instead: the names its
bytecode uses must be exactly those of one of transformers' causal-LM templates (dense, soft-capped, MoE with
auxiliary loss). A family that adds anything (logit scaling, multipliers, extra heads) uses other names and is
left alone. The adapter then reproduces that template with the kernel doing lm_head + cross-entropy.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import KernelFallbackWarning
from .._forward import RUNTIME_PROBLEM_ATTR
from .._types import Decline
from .._types import Match
from .._types import Mode
from ._context import MatchContext
from ._context import cache_keyword
from ._context import dtensor_placements
from ._context import plain_class_forward
from ._linear import linear_operands
from ._zero3 import HOOKS
from ._zero3 import MODULE
from ._zero3 import access
from ._zero3 import enter_forward
from ._zero3 import exit_forward
from ._zero3 import full_shape
from ._zero3 import hooks_problem
from ._zero3 import is_partitioned
from ._zero3 import require_whole


__all__ = ["adapt_causal_lm", "match_causal_lm"]

_COMMON = frozenset({
    "attentions", "config", "hidden_states", "last_hidden_state", "lm_head", "loss_function", "model",
    "past_key_values", "slice_logits_to_keep", "vocab_size",
})
_TEMPLATES = {
    "dense": _COMMON | {"CausalLMOutputWithPast"},
    "softcap": _COMMON | {"CausalLMOutputWithPast", "final_logit_softcapping", "tanh", "torch"},
    "moe": _COMMON | {
        "MoeCausalLMOutputWithPast", "device", "load_balancing_loss_func", "num_experts", "num_experts_per_tok",
        "output_router_logits", "router_aux_loss_coef", "router_logits", "to",
    },
}
_ARGS = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
         "use_cache")
_TEMPLATE_ARGS = {
    "dense": (*_ARGS, "logits_to_keep"),
    "softcap": (*_ARGS, "logits_to_keep"),
    "moe": (*_ARGS, "output_router_logits", "logits_to_keep"),
}


# Older transformers (up to about 5.20) spell the slice inline, `slice(-logits_to_keep, None) if
# isinstance(logits_to_keep, int) else logits_to_keep`, and take `cache_position` before `logits_to_keep`. The
# fused path only runs with logits_to_keep == 0 and forwards cache_position to the decoder as a keyword, so both
# spellings compute the same thing there.
_INLINE_SLICE = frozenset({"slice", "isinstance", "int"})


def _accepted(name: str) -> list[tuple[frozenset[str], tuple[str, ...]]]:
    names, args = _TEMPLATES[name], _TEMPLATE_ARGS[name]
    inline = (names - {"slice_logits_to_keep"}) | _INLINE_SLICE
    with_cache_position = (*args[:-1], "cache_position", args[-1])
    return [(n, a) for n in (names, inline) for a in (args, with_cache_position)]


# transformers 5.24 renamed the cache argument and output field from `past_key_values` to `cache` (the old keyword
# still accepted through a deprecation wrapper); the templates are spelled with the old name.
_RENAMED_CACHE = {"cache": "past_key_values"}


def _template(module: nn.Module) -> str | None:
    code = plain_class_forward(module).__code__
    names = frozenset(_RENAMED_CACHE.get(n, n) for n in code.co_names)
    args = tuple(_RENAMED_CACHE.get(a, a) for a in code.co_varnames[: code.co_argcount])
    for name in _TEMPLATES:
        if (names, args) in _accepted(name):
            return name
    return None


def match_causal_lm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """transformers ``*ForCausalLM`` heads whose forward is a standard template and whose loss is ForCausalLMLoss."""
    if not (isinstance(module._modules.get("lm_head"), nn.Module) and isinstance(module._modules.get("model"),
                                                                                  nn.Module)):
        return None
    if not hasattr(type(module), "loss_function") or "transformers" not in sys.modules:
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    template = _template(module)
    if template is None:
        known = _TEMPLATES["moe"] | _TEMPLATES["softcap"] | _INLINE_SLICE | set(_RENAMED_CACHE)
        names = sorted(set(plain_class_forward(module).__code__.co_names) - known)
        extra = f" (it also uses {names})" if names else ""
        return Decline("causal_lm_loss", f"forward is not a standard causal-LM template{extra}; logits may be "
                                         "post-processed, so the loss cannot be fused safely", unrecognized=True)
    try:
        loss_function = module.loss_function
    except Exception as exc:  # noqa: BLE001
        return Decline("causal_lm_loss", f"loss_function unavailable: {exc}")
    if loss_function is not ForCausalLMLoss:
        return Decline("causal_lm_loss", f"loss function is {getattr(loss_function, '__name__', loss_function)}, "
                                         "not transformers' ForCausalLMLoss")
    lm_head = module.lm_head
    # What lm_head's forward computes now, as one linear the kernel can take (a PEFT LoRA head included), or why
    # not (a quantized head, DoRA, an unknown wrapper); the fused forward asks again at every call.
    operands = linear_operands(lm_head)
    if isinstance(operands, str):
        return Decline("causal_lm_loss", operands)
    if ctx.options.get("linear", {}).get("lm_head", False):
        # The fused loss multiplies hidden states by lm_head's bf16 weight itself and never calls lm_head, so a
        # precision-changing linear kernel asked for lm_head (FP8) would be bound but never run in training.
        return Decline("causal_lm_loss", "[kinds.linear] options.lm_head asks for lm_head's own linear kernel "
                                         "(FP8): the fused loss would bypass it, so the loss runs unfused "
                                         "(lm_head, then transformers' cross-entropy)")
    blocker = _lm_head_blocker(lm_head, getattr(module, "config", None), ctx)
    if blocker:
        return Decline("causal_lm_loss", blocker)
    config = getattr(module, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None) if template == "softcap" else None
    variant = "softcap" if softcap is not None else "standard"
    if ctx.mode is not None and Mode.TRAINING not in ctx.mode:
        # The adapter fuses only training steps with labels; anything else (generation, evaluation, with or
        # without labels) runs the model's own forward, which returns the logits callers read. Bound here, the
        # kernel would be reported but never run.
        return Decline("causal_lm_loss", "the fused loss runs only in training steps with labels (mode is "
                                         f"{str(ctx.mode).removeprefix('Mode.')}); the model's own forward "
                                         "computes the logits and the loss here")
    params = {"template": template, "softcap": softcap}
    evidence = f"forward is the transformers {template} causal-LM template with ForCausalLMLoss"
    if type(lm_head) is not nn.Linear:
        evidence += (f"; lm_head is {type(lm_head).__name__}: the kernel takes its base weight plus each active "
                     "adapter's low-rank path" if hasattr(lm_head, "lora_A") else
                     f"; lm_head is {type(lm_head).__name__}: the kernel takes the weight of the layer it runs")
    if is_partitioned(lm_head.weight):
        evidence += ("; lm_head's weight is DeepSpeed ZeRO-3 partitioned: the kernel runs between lm_head's own "
                     "DeepSpeed hooks, which gather it for the forward and the backward and release it after")
    return Match("causal_lm_loss", variant, params, evidence=evidence)


def _lm_head_blocker(lm_head: nn.Module, config: object, ctx: MatchContext) -> str | None:
    """Why the fused loss, which reads ``lm_head.weight`` directly, would not compute what ``lm_head(x)`` does.
    Forward hooks are judged before, by ``linear_operands`` (DeepSpeed ZeRO-3's own are run around the kernel)."""
    placements = dtensor_placements(lm_head.weight)
    if placements is not None and not ctx.fsdp_managed(lm_head):
        return f"lm_head weight is a DTensor {placements} (tensor parallel); the fused loss needs the whole vocabulary"
    if placements is not None:
        # FSDP2 gathers lm_head's shards in the root's pre-forward hook, before the fused loss reads the weight,
        # but only over FSDP's own mesh dimensions: a parameter that was already a DTensor when fully_shard took it
        # (tensor parallel; FSDPParam.is_dtensor) is gathered back into that DTensor, still split over the TP
        # dimension, and the fused loss's plain matmul against it fails. The sharded weight cannot tell: FSDP x TP
        # and HSDP (whose gathered weight is plain) both shard it over a 2-D mesh, and FSDP keeps its per-parameter
        # state private. So gather once (one all-gather of lm_head's FSDP unit, in step on every rank like the
        # probes) and look at what the forward will read.
        with ctx.unsharded(lm_head):
            gathered = lm_head.weight
            gathered_placements = dtensor_placements(gathered)
            if gathered_placements is not None:
                names = gathered.device_mesh.mesh_dim_names
                where = (f"mesh dim{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)}" if names
                         else "a device mesh")
                return (f"lm_head's weight is tensor-parallel (inside FSDP it is still a DTensor "
                        f"{gathered_placements} on {where} after FSDP gathers it); the fused loss needs the whole "
                        "weight")
    vocab = getattr(config, "vocab_size", None)
    rows = full_shape(lm_head.weight)[0]  # a ZeRO-3 partitioned weight's data is empty; its whole shape counts
    if isinstance(vocab, int) and rows != vocab:
        return f"lm_head has {rows} rows for a vocabulary of {vocab} (sharded?)"
    return None


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # Same as ForCausalLMLoss: pad one ignore_index on the right, then drop the first position.
    padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:].contiguous()


def _use_cache(base: nn.Module, call: dict[str, Any], cache: str) -> bool:
    """Whether the fused path's call of the base model builds a KV cache: as few as compute what eager computes.

    A training step with labels never generates, so where a cache changes nothing but memory none is built.
    transformers otherwise defaults to ``config.use_cache=True`` and keeps every layer's keys and values in a cache
    alive until the output is dropped, through the loss, the step's peak: measured on the H200 for Qwen3-0.6B,
    0.875 GiB there, plus as much again in zero gradients that a torch.compile'd graph creates for the cache
    outputs at the start of backward.

    A cache changes the math in one case: transformers looks for packed sequences (position ids restarting at 0)
    and masks attention per document only when the model was given position ids, no attention mask and no cache.
    Where the eager call would build a cache there (``use_cache`` from the config, as transformers'
    ``merge_with_config_defaults`` takes it, gradient checkpointing turning it off in training), eager attends
    across the packed documents, so this call builds the cache too and computes the same.
    """
    use_cache = call.get("use_cache")
    if use_cache is not None:
        return bool(use_cache)
    if call.get(cache) is not None:
        return True
    if call.get("position_ids") is None or call.get("attention_mask") is not None:
        return False
    config_default = bool(getattr(getattr(base, "config", None), "use_cache", False))
    checkpointing = getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled()
    return config_default and not checkpointing


def _partitioned_head(lm_head: nn.Module, how: object) -> str | None:
    """Why the fused loss cannot read ``lm_head``'s weights now, under DeepSpeed ZeRO-3, or None.

    The kernel reads lm_head's weight without calling lm_head. Under ZeRO-3 it runs between lm_head's own hooks,
    which gather the weight; where only calling lm_head would gather it (hooks of another origin too, or none), the
    model's own forward runs instead. A wrapped head (LoRA) keeps its parameters in child modules, which its own
    hooks do not gather: partitioned, the model's own forward runs too.
    """
    if how == MODULE:
        return ("lm_head's weight is partitioned (DeepSpeed ZeRO-3) and carries hooks of another origin, so only "
                "calling lm_head gathers it")
    if type(lm_head) is not nn.Linear and any(is_partitioned(p) for p in lm_head.parameters()):
        return (f"lm_head is a {type(lm_head).__module__}.{type(lm_head).__qualname__} (a PEFT wrapper) whose "
                "parameters DeepSpeed ZeRO-3 partitions, and only its own forward gathers them; the fused loss runs "
                "with a LoRA head under ZeRO-2, FSDP2 or DDP")
    return None


def adapt_causal_lm(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    """Fused path in training with labels; the original forward (with logits) everywhere else."""
    original = type(module).forward.__get__(module, type(module))
    template = match.params["template"]
    softcap = match.params["softcap"]
    plain = plain_class_forward(module)
    namespace = plain.__globals__
    # The forward's own parameter names, in order (the cache one spelled as this transformers spells it).
    arg_names = plain.__code__.co_varnames[1: plain.__code__.co_argcount]
    cache = cache_keyword(plain)
    materialize = bool(options.get("materialize_logits", False))
    output_name = "MoeCausalLMOutputWithPast" if template == "moe" else "CausalLMOutputWithPast"
    warned: set[str] = set()  # fallback reasons already warned about, for this binding

    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(arg_names) or any(n in kwargs for n in arg_names[: len(args)]):
            return original(*args, **kwargs)  # raises the forward's own TypeError
        call = {**dict(zip(arg_names, args, strict=False)), **kwargs}
        if cache != "past_key_values" and "past_key_values" in call:
            # What transformers' deprecation wrapper does for the old keyword, minus its warning.
            old = call.pop("past_key_values")
            call.setdefault(cache, old)
        labels = call.pop("labels", None)
        logits_to_keep = call.pop("logits_to_keep", 0)
        fused = (
            labels is not None and module.training and torch.is_grad_enabled() and not materialize
            and isinstance(logits_to_keep, int) and logits_to_keep == 0
        )
        if not fused:
            return original(*args, **kwargs)
        # lm_head as it is now: PEFT may have wrapped it after kernelize (LoRA, modules_to_save), and its .weight
        # would then be the frozen base layer's; a head the kernel cannot reproduce runs the model's own forward.
        head = linear_operands(module.lm_head, hooks=False)
        if isinstance(head, str):
            if head not in warned:
                warned.add(head)
                warnings.warn(f"kernels-core: the fused causal-LM loss of {type(module).__name__} falls back to the "
                              f"model's own forward (full logits) for this model: {head}", KernelFallbackWarning,
                              stacklevel=2)
            return original(*args, **kwargs)
        lm_head = module.lm_head
        how = access(lm_head, lm_head._parameters.get("weight"))
        routed = _partitioned_head(lm_head, how)
        if routed is not None:
            if routed not in warned:
                warned.add(routed)
                warnings.warn(f"kernels-core: the fused causal-LM loss of {type(module).__name__} falls back to the "
                              f"model's own forward (full logits): {routed}", KernelFallbackWarning, stacklevel=2)
            return original(*args, **kwargs)
        return_dict = call.pop("return_dict", None)
        if template == "moe":
            if call.get("output_router_logits") is None:
                call["output_router_logits"] = module.config.output_router_logits
            output_router_logits = call["output_router_logits"]
        call["use_cache"] = _use_cache(module.model, call, cache)
        outputs = module.model(**call)
        hidden = outputs.last_hidden_state
        ignore_index = call.get("ignore_index", -100)
        shift_labels = call.get("shift_labels")
        if shift_labels is None:
            shift_labels = _shift(labels, ignore_index)
        inputs: tuple[Any, ...] = (hidden.reshape(-1, hidden.shape[-1]),)
        if how == HOOKS:
            inputs = enter_forward(lm_head, inputs)
            require_whole(lm_head.weight, "lm_head.weight")
            require_whole(lm_head.bias, "lm_head.bias")
        rows, weight, bias = head(inputs[0])
        loss = impl(
            rows,
            weight,
            shift_labels.reshape(-1).to(hidden.device),
            bias=bias,
            ignore_index=ignore_index,
            num_items_in_batch=call.get("num_items_in_batch"),
            softcap=softcap,
        )
        if how == HOOKS:
            loss = exit_forward(lm_head, inputs, loss)
        extra: dict[str, Any] = {}
        if template == "moe":
            aux_loss = None
            if output_router_logits:
                aux_loss = namespace["load_balancing_loss_func"](
                    outputs.router_logits, module.num_experts, module.num_experts_per_tok, call.get("attention_mask")
                )
                loss = loss + module.router_aux_loss_coef * aux_loss.to(loss.device)
            extra = {"aux_loss": aux_loss, "router_logits": outputs.router_logits}
        result = namespace[output_name](
            loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            **{cache: getattr(outputs, cache)}, **extra,
        )
        return result.to_tuple() if return_dict is False else result


    def runtime_problem() -> str | None:
        # What get_report says of this binding now: the per-call routes above that depend on the model, not on the
        # call. Whether a weight is whole depends on the moment (an ancestor's ZeRO-3 hooks gather it during the
        # forward), so outside a forward only what holds at every moment counts: a head the kernel cannot reproduce,
        # a partitioned PEFT head, a partitioned weight beside hooks of another origin.
        lm_head = module.lm_head
        head = linear_operands(lm_head, hooks=False)
        if isinstance(head, str):
            return head
        weight = lm_head._parameters.get("weight")
        foreign = hooks_problem(lm_head) is not None and weight is not None and is_partitioned(weight)
        return _partitioned_head(lm_head, MODULE if foreign else HOOKS)

    setattr(forward, RUNTIME_PROBLEM_ATTR, runtime_problem)
    return forward
