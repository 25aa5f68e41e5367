"""Causal-LM loss: a ``*ForCausalLM`` forward that, in training, never materialises the logits.

Only kernelize for ``Mode.TRAINING`` binds it: in inference the forward must return logits, so the kernel would
never run, and the module is declined with that reason.

The matcher checks the math, not the spelling of the forward: with the base model (``module.model``) stood in for
by a stub that returns known hidden states, it runs the forward once without and once with labels and reads off

- what ``lm_head`` receives: the hidden states, or the hidden states divided / multiplied by a configuration value
  (MiniCPM's ``h / (hidden_size / dim_model_base)``);
- what the forward returns as logits: ``lm_head``'s output, or that times / over a configuration value (Granite's
  ``logits_scaling``, Command-R's ``logit_scale``), or soft-capped by ``final_logit_softcapping`` (Gemma 2);
- that the loss it returns is transformers' ``ForCausalLMLoss`` of those logits, plus, where the forward calls
  ``load_balancing_loss_func``, the MoE auxiliary loss times its coefficient (checked with stub router logits).

Whatever output class the forward returns (an MoE one with router logits and an auxiliary loss, say) is returned by
the fused path too, its other fields taken from the base model's output. Anything else done to the logits or added
to the loss is declined with what differs. The adapter then computes lm_head + cross-entropy in one kernel, the
logit scale passed to it (variant ``scaled``) and the input scaling done as the forward does it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import KernelFallbackWarning
from .._forward import RUNTIME_PROBLEM_ATTR
from .._tolerance import probe_tolerance
from .._types import Decline
from .._types import Match
from .._types import Mode
from ._context import MatchContext
from ._context import cache_keyword
from ._context import dtensor_placements
from ._context import param_dtype
from ._context import plain_class_forward
from ._context import rel_error
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

KIND = "causal_lm_loss"
_HALF = (torch.bfloat16, torch.float16)

# The names every causal-LM forward the matcher probes uses: the base model, the head and the loss.
_REQUIRED = frozenset({"model", "lm_head", "loss_function"})
# What the forward may hand the base model besides what the fused path hands on (the caller's own arguments): the
# flags the fused path sets itself, and nothing else that is not None.
_FLAGS = frozenset({"use_cache", "output_router_logits", "return_dict", "output_attentions", "output_hidden_states"})
# The MoE auxiliary loss: transformers' templates name its coefficient one of these.
_AUX_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
_PROBE_TOKENS = 6
_PROBE_EXPERTS = 4


# transformers 5.24 renamed the cache argument and output field from `past_key_values` to `cache` (the old keyword
# still accepted through a deprecation wrapper).
_CACHE_NAMES = ("cache", "past_key_values")


class _StubOutput(dict):
    """What the stub base model returns: fields by attribute (None when absent, like a ModelOutput's unset fields)
    and by position (``outputs[0]`` is the last hidden state)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        return list(self.values())[key] if isinstance(key, int) else dict.__getitem__(self, key)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(v for v in self.values() if v is not None)


class _StubModel(nn.Module):
    """Stands in for ``module.model`` during the probe: returns ``hidden`` (and ``router_logits``), records what the
    forward handed it."""

    def __init__(self, hidden: torch.Tensor, router_logits: tuple[torch.Tensor, ...] | None) -> None:
        super().__init__()
        self.hidden = hidden
        self.router_logits = router_logits
        self.calls: list[dict[str, Any]] = []

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        self.calls.append({"*args": args, **kwargs})
        return _StubOutput(last_hidden_state=self.hidden, router_logits=self.router_logits)


@dataclasses.dataclass(frozen=True)
class _Scalar:
    """A configuration value and how the forward applies it: ``x * value`` or ``x / value``."""

    name: str
    value: float
    op: str  # "mul" or "div"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value if self.op == "mul" else x / self.value

    @property
    def factor(self) -> float:
        return self.value if self.op == "mul" else 1.0 / self.value

    def __str__(self) -> str:
        return f"{'*' if self.op == 'mul' else '/'} {self.name} ({self.value:g})"


def _scalars(module: nn.Module) -> list[tuple[str, float]]:
    """Named numbers a forward may scale by: the module's own attributes and its configuration's (not 0 or 1)."""
    found: dict[str, float] = {}
    sources = [("", vars(module))]
    config = getattr(module, "config", None)
    if config is not None:
        sources.append(("config.", vars(config)))
        text = getattr(config, "get_text_config", None)
        try:
            sub = text() if callable(text) else None
        except Exception:  # noqa: BLE001 - several text configs: the top-level one serves
            sub = None
        if sub is not None and sub is not config:
            sources.append(("config.text_config.", vars(sub)))
    for prefix, values in sources:
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
                found.setdefault(f"{prefix}{key}", float(value))
    if config is not None:  # MiniCPM divides by a ratio of two settings
        hidden, base = getattr(config, "hidden_size", None), getattr(config, "dim_model_base", None)
        if isinstance(hidden, int) and isinstance(base, (int, float)) and base:
            found.setdefault("config.hidden_size / config.dim_model_base", hidden / base)
    return list(found.items())


def _same(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    return (actual.shape == expected.shape and bool(torch.isfinite(actual).all())
            and rel_error(actual.float(), expected.float()) <= probe_tolerance(dtype))


def _find_scalar(before: torch.Tensor, after: torch.Tensor, module: nn.Module, dtype: torch.dtype) -> _Scalar | None:
    """The configuration value ``after`` is ``before`` times or over, as the forward computes it, if any."""
    b, a = before.float(), after.float()
    ratio = float((a * b).sum() / (b * b).sum().clamp_min(1e-30))
    for name, value in _scalars(module):
        for op in ("mul", "div"):
            scalar = _Scalar(name, value, op)
            if abs(scalar.factor - ratio) <= 1e-2 * abs(ratio) and _same(after, scalar.apply(before), dtype):
                return scalar
    return None


def _aux_coefficient(module: nn.Module, names: frozenset[str]) -> str | None:
    """The attribute holding the MoE auxiliary loss's coefficient, where the forward adds that loss."""
    for name in _AUX_COEFFICIENTS:
        if name in names and isinstance(getattr(module, name, None), (int, float)):
            return name
    return None


@dataclasses.dataclass(frozen=True)
class _HeadForward:
    """What a ``*ForCausalLM`` forward's code says about itself before it runs: its source of truth for the probe."""

    plain: Callable[..., Any]
    signature: Any  # inspect's ordered mapping of the forward's parameters
    takes_kwargs: bool
    aux: str | None  # the MoE auxiliary-loss coefficient's attribute, where the forward adds that loss


@dataclasses.dataclass
class _ProbeRun:
    """One probe run's outputs: without labels, with labels, with router logits; lm_head's calls; the stub's calls."""

    bare: Any
    labelled: Any
    routed: Any
    heads: list[tuple[torch.Tensor, torch.Tensor]]
    calls: list[dict[str, Any]]


def _head_forward(module: nn.Module) -> _HeadForward | str:
    """The forward's parameters and MoE auxiliary loss, or why it is not a head over a base model's hidden states."""
    plain = plain_class_forward(module)
    names = frozenset(plain.__code__.co_names)
    missing = sorted(_REQUIRED - names)
    if missing:
        return f"forward does not use {missing}; it is not a head over a base model's hidden states"
    signature = inspect.signature(plain).parameters
    if "labels" not in signature:
        return "forward takes no labels"
    aux = None
    if "load_balancing_loss_func" in names:
        aux = _aux_coefficient(module, names)
        experts = [n for n in ("num_experts", "num_experts_per_tok") if not isinstance(getattr(module, n, None), int)]
        if aux is None or experts or "output_router_logits" not in signature:
            return ("forward adds an MoE load-balancing loss from settings the fused path does not know (no "
                    f"{' / '.join(_AUX_COEFFICIENTS)}, num_experts and num_experts_per_tok attributes, or no "
                    "output_router_logits argument)")
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    return _HeadForward(plain, signature, takes_kwargs, aux)


def _probe_head(module: nn.Module, ctx: MatchContext) -> dict[str, Any] | str:
    """The match's parameters from probing the forward around a stub base model, or what differs from the math.

    Two runs (without labels, with labels), in eval and in training behaviour; the hidden states are random, the
    labels a permutation of the probe's token ids. Where the forward calls ``load_balancing_loss_func``, the stub
    also returns router logits and the run with labels asks for them, so the auxiliary loss is checked too.
    """
    head = _head_forward(module)
    if isinstance(head, str):
        return head
    weight = module.lm_head.weight
    if weight.device.type == "meta":
        return "parameters are on the meta device; the math cannot be verified"
    vocab, width = full_shape(weight)
    dtype = param_dtype(module.lm_head) or weight.dtype
    gen = ctx.generator(weight.device)
    hidden = ctx.randn(1, _PROBE_TOKENS, width, device=weight.device, dtype=dtype, gen=gen)
    router = None
    if head.aux is not None:
        router = tuple(ctx.randn(_PROBE_TOKENS, max(module.num_experts, 1), device=weight.device, dtype=dtype,
                                 gen=gen) for _ in range(2))
    ids = torch.arange(_PROBE_TOKENS, device=weight.device)[None] % vocab
    handed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if (
        head.takes_kwargs or "attention_mask" in head.signature) else {"input_ids": ids}
    labels = ids.flip(-1)
    runs = _probe_runs(module, ctx, head, hidden, router, handed, labels=labels)
    if isinstance(runs, str):
        return runs
    found: dict[str, Any] = {}
    for run in runs:
        verdict = _read_run(module, head, run, hidden, router, handed, labels=labels, dtype=dtype)
        if isinstance(verdict, str):
            return verdict
        if found and found != verdict:
            return "the forward's math differs between eval and training behaviour"
        found = verdict
    return found


def _probe_runs(module: nn.Module, ctx: MatchContext, head: _HeadForward, hidden: torch.Tensor,
                router: tuple[torch.Tensor, ...] | None, handed: dict[str, torch.Tensor], *,
                labels: torch.Tensor) -> list[_ProbeRun] | str:
    """The forward's runs around a stub base model returning ``hidden`` (in eval and training behaviour)."""
    flags = {"output_router_logits": False} if "output_router_logits" in head.signature else {}
    stub = _StubModel(hidden, router)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        seen.append((args[0], output))

    forward = ctx.original_forward(module)

    def run() -> _ProbeRun:
        seen.clear()
        stub.calls.clear()
        bare = forward(**handed, **flags)
        labelled = forward(**handed, **flags, labels=labels)
        routed = forward(**handed, output_router_logits=True, labels=labels) if head.aux is not None else None
        return _ProbeRun(bare, labelled, routed, list(seen), list(stub.calls))

    saved = module._modules["model"]
    hook = module.lm_head.register_forward_hook(capture)
    try:
        module._modules["model"] = stub
        return list(ctx.run_probe(module, run))
    except Exception as exc:  # noqa: BLE001 - a forward that needs more of its base model: left alone
        return f"probe of the forward around a stub base model raised {type(exc).__name__}: {exc}"
    finally:
        module._modules["model"] = saved
        hook.remove()


def _read_run(module: nn.Module, head: _HeadForward, run: _ProbeRun, hidden: torch.Tensor,
              router: tuple[torch.Tensor, ...] | None, handed: dict[str, torch.Tensor], *, labels: torch.Tensor,
              dtype: torch.dtype) -> dict[str, Any] | str:
    """The scale, divisor or soft-cap one run shows between the hidden states, lm_head and the logits, or what
    differs from the fused path's math."""
    logits = getattr(run.bare, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != handed["input_ids"].shape:
        return "forward returns no logits of shape [batch, tokens, vocab]"
    problem = _calls_problem(run, hidden, handed, expected_heads=3 if head.aux is not None else 2)
    if problem is not None:
        return problem
    head_in, head_out = run.heads[0]
    into = None
    if not (head_in is hidden or torch.equal(head_in, hidden)):
        into = _find_scalar(hidden, head_in, module, dtype)
        if into is None:
            return ("lm_head does not receive the base model's hidden states, nor those times or over a "
                    "configuration value: they are transformed in a way the fused path cannot reproduce")
    scale = softcap = None
    if not torch.equal(logits, head_out):
        cap = getattr(module.config, "final_logit_softcapping", None)
        if isinstance(cap, (int, float)) and cap > 0 and _same(logits, torch.tanh(head_out / cap) * cap, dtype):
            softcap = float(cap)
        else:
            scale = _find_scalar(head_out, logits, module, dtype)
            if scale is None:
                err = rel_error(logits.float(), head_out.float()) if logits.shape == head_out.shape else None
                by = f" (rel. difference {err:.1e})" if err is not None else ""
                return ("the logits it returns are not lm_head's output, nor that times or over a configuration "
                        f"value, nor soft-capped by final_logit_softcapping{by}: they are post-processed in a "
                        "way the fused kernel cannot reproduce")
    problem = _loss_problem(module, head, run, logits, router, handed, labels=labels)
    if problem is not None:
        return problem
    output = type(run.bare)
    if head.plain.__globals__.get(output.__name__) is not output or not dataclasses.is_dataclass(output):
        return f"forward returns a {output.__name__}, not a transformers ModelOutput its module names"
    return {"into": into, "scale": scale, "softcap": softcap, "aux": head.aux, "output": output.__name__,
            "router_flag": "output_router_logits" in head.signature}


def _calls_problem(run: _ProbeRun, hidden: torch.Tensor, handed: dict[str, torch.Tensor], *,
                   expected_heads: int) -> str | None:
    """What in lm_head's calls or the base model's arguments the fused path would not reproduce, if anything."""
    if len(run.heads) != expected_heads or not all(h[0].shape == hidden.shape for h in run.heads):
        return f"lm_head ran {len(run.heads)} times over the probe's runs, not once per forward on every token"
    for call in run.calls:
        if call["*args"] or any(call.get(k) is not v for k, v in handed.items()):
            return "forward does not hand its input_ids and attention_mask on to the base model as keywords"
        odd = sorted(k for k, v in call.items() if k != "*args" and k not in handed and k not in _FLAGS
                     and k not in _CACHE_NAMES and v is not None)
        if odd:
            return f"forward hands {odd} to the base model, which the fused path would not"
    return None


def _loss_problem(module: nn.Module, head: _HeadForward, run: _ProbeRun, logits: torch.Tensor,
                  router: tuple[torch.Tensor, ...] | None, handed: dict[str, torch.Tensor], *,
                  labels: torch.Tensor) -> str | None:
    """How the returned loss differs from ForCausalLMLoss of the logits (plus the MoE auxiliary loss), if it does."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def own_logits(output: Any) -> torch.Tensor:
        # The logits of the same call: a second forward may differ from the first by dropout (a PEFT LoRA adapter
        # on lm_head, in training mode).
        mine = getattr(output, "logits", None)
        return mine if isinstance(mine, torch.Tensor) and mine.shape == logits.shape else logits

    expected = ForCausalLMLoss(own_logits(run.labelled), labels, vocab_size=logits.shape[-1])
    loss = getattr(run.labelled, "loss", None)
    if not (isinstance(loss, torch.Tensor) and _same(loss, expected, torch.float32)):
        return ("the loss it returns is not transformers' ForCausalLMLoss of the logits it returns (another "
                "reduction, or an extra term)")
    if head.aux is None:
        return None
    balance = head.plain.__globals__["load_balancing_loss_func"]
    try:
        term = balance(router, module.num_experts, module.num_experts_per_tok, torch.ones_like(handed["input_ids"]))
    except Exception as exc:  # noqa: BLE001 - a family's own routing (Doge's product keys)
        return (f"its load_balancing_loss_func takes router logits of another form than [tokens, experts] "
                f"({type(exc).__name__}: {exc}); the fused path could not reproduce the auxiliary loss")
    base = ForCausalLMLoss(own_logits(run.routed), labels, vocab_size=logits.shape[-1])
    want = base + getattr(module, head.aux) * term.to(base.device)
    routed_loss = getattr(run.routed, "loss", None)
    if not (isinstance(routed_loss, torch.Tensor) and _same(routed_loss, want, torch.float32)):
        return (f"with router logits, the loss it returns is not ForCausalLMLoss + {head.aux} * "
                "load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)")
    return None


def match_causal_lm(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """transformers ``*ForCausalLM`` heads whose logits are ``lm_head(h)`` up to a known scale, divisor or soft-cap
    and whose loss is ForCausalLMLoss of them (plus an MoE auxiliary loss), verified by a probe."""
    if not (isinstance(module._modules.get("lm_head"), nn.Module) and isinstance(module._modules.get("model"),
                                                                                  nn.Module)):
        return None
    if not hasattr(type(module), "loss_function") or "transformers" not in sys.modules:
        return None
    if getattr(plain_class_forward(module), "__code__", None) is None:
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    try:
        loss_function = module.loss_function
    except Exception as exc:  # noqa: BLE001
        return Decline(KIND, f"loss_function unavailable: {exc}")
    if loss_function is not ForCausalLMLoss:
        return Decline(KIND, f"loss function is {getattr(loss_function, '__name__', loss_function)}, "
                             "not transformers' ForCausalLMLoss")
    lm_head = module.lm_head
    # What lm_head's forward computes now, as one linear the kernel can take (a PEFT LoRA head included), or why
    # not (a quantized head, DoRA, an unknown wrapper); the fused forward asks again at every call.
    operands = linear_operands(lm_head)
    if isinstance(operands, str):
        return Decline(KIND, operands)
    if ctx.options.get("linear", {}).get("lm_head", False):
        # The fused loss multiplies hidden states by lm_head's bf16 weight itself and never calls lm_head, so a
        # precision-changing linear kernel asked for lm_head (FP8) would be bound but never run in training.
        return Decline(KIND, "[kinds.linear] options.lm_head asks for lm_head's own linear kernel "
                             "(FP8): the fused loss would bypass it, so the loss runs unfused "
                             "(lm_head, then transformers' cross-entropy)")
    blocker = _lm_head_blocker(lm_head, getattr(module, "config", None), ctx)
    if blocker:
        return Decline(KIND, blocker)
    if ctx.mode is not None and Mode.TRAINING not in ctx.mode:
        # The adapter fuses only training steps with labels; anything else (generation, evaluation, with or
        # without labels) runs the model's own forward, which returns the logits callers read. Bound here, the
        # kernel would be reported but never run.
        return Decline(KIND, "the fused loss runs only in training steps with labels (mode is "
                             f"{str(ctx.mode).removeprefix('Mode.')}); the model's own forward "
                             "computes the logits and the loss here")
    with ctx.unsharded(lm_head):
        found = _probe_head(module, ctx)
    if isinstance(found, str):
        return Decline(KIND, found, unrecognized=True)
    scale, softcap, into = found["scale"], found["softcap"], found["into"]
    variant = "scaled" if scale is not None else "softcap" if softcap is not None else "standard"
    params = {
        "softcap": softcap, "logit_scale": None if scale is None else scale.factor, "aux": found["aux"],
        "output": found["output"], "router_flag": found["router_flag"],
        "hidden_op": None if into is None else (into.op, into.value),
    }
    evidence = "probe: the logits are lm_head(h)"
    if into is not None:
        evidence = f"probe: the logits are lm_head(h {into})"
    if scale is not None:
        evidence += f" {scale} (folded into the kernel as logit_scale={scale.factor:g})"
        if math.frexp(scale.factor)[0] != 0.5 and (param_dtype(lm_head) or lm_head.weight.dtype) in _HALF:
            # Eager rounds s * z in the model dtype; a kernel that scales elsewhere differs within a stated bound.
            evidence += (" (not a power of two: in half precision a kernel that scales other than in the logits' "
                         "dtype differs from eager by at most one rounding of each logit and scaled hidden value, "
                         "as the kernel conventions bound it)")
    if softcap is not None:
        evidence += f" soft-capped at {softcap:g}"
    evidence += ", the loss ForCausalLMLoss of them"
    if found["aux"]:
        evidence += f" + {found['aux']} * the MoE load-balancing loss"
    evidence += f"; returns {found['output']}"
    if type(lm_head) is not nn.Linear:
        evidence += (f"; lm_head is {type(lm_head).__name__}: the kernel takes its base weight plus each active "
                     "adapter's low-rank path" if hasattr(lm_head, "lora_A") else
                     f"; lm_head is {type(lm_head).__name__}: the kernel takes the weight of the layer it runs")
    if is_partitioned(lm_head.weight):
        evidence += ("; lm_head's weight is DeepSpeed ZeRO-3 partitioned: the kernel runs between lm_head's own "
                     "DeepSpeed hooks, which gather it for the forward and the backward and release it after")
    return Match(KIND, variant, params, evidence=evidence)


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


@dataclasses.dataclass(frozen=True)
class _FusedHead:
    """What the fused forward of one ``*ForCausalLM`` module needs, read once at binding time."""

    module: nn.Module
    original: Callable[..., Any]  # the module's own forward, bound
    impl: Callable[..., Any]
    softcap: float | None
    scaled: dict[str, float]  # {"logit_scale": s} for the scaled variant, else empty
    hidden_op: tuple[str, float] | None
    aux: str | None
    namespace: dict[str, Any]  # the forward's module globals (its output class, load_balancing_loss_func)
    output_class: type
    fields: frozenset[str]
    arg_names: tuple[str, ...]  # the forward's own parameter names, in order
    cache: str  # the cache keyword as this transformers spells it
    router_flag: bool
    warned: set[str]  # fallback reasons already warned about, for this binding

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The call's arguments by name, or None where they do not bind (the forward then raises its own error)."""
        if len(args) > len(self.arg_names) or any(n in kwargs for n in self.arg_names[: len(args)]):
            return None
        call = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        if self.cache != "past_key_values" and "past_key_values" in call:
            # What transformers' deprecation wrapper does for the old keyword, minus its warning.
            old = call.pop("past_key_values")
            call.setdefault(self.cache, old)
        return call

    def fallback(self, reason: str) -> None:
        """Warn, once per reason for this binding, that this call runs the model's own forward."""
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"kernels-core: the fused causal-LM loss of {type(self.module).__name__} falls back to "
                          f"the model's own forward (full logits): {reason}", KernelFallbackWarning, stacklevel=3)

    def loss(self, call: dict[str, Any], labels: torch.Tensor, head: Any, how: object) -> Any:
        """The base model's forward, then the fused loss over lm_head's operands, as the model's output class."""
        module, lm_head = self.module, self.module.lm_head
        return_dict = call.pop("return_dict", None)
        output_router_logits = False
        if self.router_flag:
            if call.get("output_router_logits") is None:
                call["output_router_logits"] = module.config.output_router_logits
            output_router_logits = call["output_router_logits"]
        call["use_cache"] = _use_cache(module.model, call, self.cache)
        outputs = module.model(**call)
        hidden = outputs.last_hidden_state
        if self.hidden_op is not None:
            # As the forward does it, in the model's dtype (MiniCPM: h / (hidden_size / dim_model_base)).
            op, value = self.hidden_op
            hidden = hidden * value if op == "mul" else hidden / value
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
        loss = self.impl(rows, weight, shift_labels.reshape(-1).to(hidden.device), bias=bias,
                         ignore_index=ignore_index, num_items_in_batch=call.get("num_items_in_batch"),
                         softcap=self.softcap, **self.scaled)
        if how == HOOKS:
            loss = exit_forward(lm_head, inputs, loss)
        extra: dict[str, Any] = {}
        if self.aux is not None:
            aux_loss = None
            if output_router_logits:
                aux_loss = self.namespace["load_balancing_loss_func"](
                    outputs.router_logits, module.num_experts, module.num_experts_per_tok, call.get("attention_mask"))
                loss = loss + getattr(module, self.aux) * aux_loss.to(loss.device)
            extra["aux_loss"] = aux_loss
        # The output class the forward returns, its other fields (router logits, ...) from the base model's output.
        for field in ("hidden_states", "attentions", "router_logits", self.cache):
            if field in self.fields and field not in extra:
                extra[field] = getattr(outputs, field, None)
        result = self.output_class(loss=loss, logits=None, **{k: v for k, v in extra.items() if k in self.fields})
        return result.to_tuple() if return_dict is False else result


def adapt_causal_lm(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    """Fused path in training with labels; the original forward (with logits) everywhere else."""
    plain = plain_class_forward(module)
    logit_scale = match.params.get("logit_scale")
    output_class = plain.__globals__[match.params["output"]]
    fused = _FusedHead(
        module=module, original=type(module).forward.__get__(module, type(module)), impl=impl,
        softcap=match.params["softcap"],
        # Kernels of the "standard" and "softcap" variants predate logit_scale: it is passed only when set.
        scaled={} if logit_scale is None else {"logit_scale": logit_scale},
        hidden_op=match.params.get("hidden_op"), aux=match.params.get("aux"), namespace=plain.__globals__,
        output_class=output_class, fields=frozenset(f.name for f in dataclasses.fields(output_class)),
        arg_names=plain.__code__.co_varnames[1: plain.__code__.co_argcount], cache=cache_keyword(plain),
        router_flag=bool(match.params.get("router_flag")), warned=set())
    materialize = bool(options.get("materialize_logits", False))

    def forward(*args: Any, **kwargs: Any) -> Any:
        call = fused.arguments(args, kwargs)
        if call is None:
            return fused.original(*args, **kwargs)  # raises the forward's own TypeError
        labels = call.pop("labels", None)
        logits_to_keep = call.pop("logits_to_keep", 0)
        if not (labels is not None and module.training and torch.is_grad_enabled() and not materialize
                and isinstance(logits_to_keep, int) and logits_to_keep == 0):
            return fused.original(*args, **kwargs)
        # lm_head as it is now: PEFT may have wrapped it after kernelize (LoRA, modules_to_save), and its .weight
        # would then be the frozen base layer's; a head the kernel cannot reproduce runs the model's own forward.
        head = linear_operands(module.lm_head, hooks=False)
        if isinstance(head, str):
            fused.fallback(head)
            return fused.original(*args, **kwargs)
        how = access(module.lm_head, module.lm_head._parameters.get("weight"))
        routed = _partitioned_head(module.lm_head, how)
        if routed is not None:
            fused.fallback(routed)
            return fused.original(*args, **kwargs)
        return fused.loss(call, labels, head, how)

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
