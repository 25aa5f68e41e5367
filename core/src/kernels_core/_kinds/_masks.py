"""The causal attention mask a transformers base model builds, rerouted per instance like ``apply_rotary_pos_emb``.

transformers' ``create_causal_mask`` returns no mask at all for unpadded causal inputs, so that SDPA runs its
``is_causal`` kernels (FlashAttention, cuDNN), which skip the masked half of the scores. While Dynamo traces the
same call, transformers builds a dense ``[B, 1, S, S]`` mask instead: 5.17 always does, 5.23 does on torch 2.11,
and any version does without a cache (it then looks for packed sequences in the position ids). SDPA then computes
the whole square: on an H200 a compiled Qwen3-0.6B step spent 2.3-2.7x the time of the same causal SDPA call in
attention (``attention_bench.py``, ``qwen3_bench.py --profile``). A kernel of this kind decides, from static facts
only, when the mask can be left out under tracing exactly as it is eagerly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import Decline
from .._types import Match
from ._context import MatchContext
from ._context import cache_keyword
from ._context import plain_class_forward
from ._context import reroute_blocker


__all__ = ["GLOBAL_NAME", "adapt_causal_mask", "match_causal_mask"]

GLOBAL_NAME = "create_causal_mask"
_TRANSFORMERS_MODULE = "transformers.masking_utils"


def match_causal_mask(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Base models whose forward builds its full-attention mask with transformers' ``create_causal_mask``."""
    code = getattr(plain_class_forward(module), "__code__", None)
    if code is None or GLOBAL_NAME not in code.co_names:
        return None
    return _classify(module)


def _classify(module: nn.Module) -> Match | Decline:
    blocker = reroute_blocker(module, GLOBAL_NAME)
    if blocker:
        return Decline("causal_mask", blocker)
    fn = plain_class_forward(module).__globals__[GLOBAL_NAME]
    if getattr(fn, "__module__", None) != _TRANSFORMERS_MODULE:
        return Decline("causal_mask", f"{GLOBAL_NAME} is {fn.__module__}.{fn.__qualname__}, not transformers' own; "
                                      "its masking rules are unknown")
    config = getattr(module, "config", None)
    code = plain_class_forward(module).__code__
    window = getattr(config, "sliding_window", None)
    if "mask_function" in code.co_varnames and "sliding_window" in code.co_names and window is not None:
        # Mistral's template: ``mask_function = create_causal_mask if self.config.sliding_window is None else
        # create_sliding_window_causal_mask``; a kernel bound here would never be called.
        return Decline("causal_mask", f"the forward builds its mask with create_sliding_window_causal_mask "
                                      f"(config.sliding_window = {window}), never calling {GLOBAL_NAME}")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return Decline("causal_mask", f"attention implementation is {implementation!r}; only 'sdpa' takes "
                                      "is_causal in place of a mask")
    if not getattr(config, "is_causal", True):
        return Decline("causal_mask", "the model's attention is bidirectional (config.is_causal is False)")
    # The kernel returns, while tracing, what the function returns eagerly for unpadded inputs: check that it does
    # return no mask there (transformers versions that always build one would make the shortcut change the math).
    parameter = next((p for p in module.parameters() if p.is_floating_point()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    if device.type == "meta":
        return Decline("causal_mask", "parameters are on the meta device; the mask function cannot be probed")
    embeds = torch.zeros(1, 4, 2, device=device)
    try:
        with torch.no_grad():
            eager = fn(config=config, inputs_embeds=embeds, attention_mask=None,
                       position_ids=torch.arange(4, device=device)[None], **{cache_keyword(fn): None})
    except Exception as exc:  # noqa: BLE001 - an unknown signature: leave the model alone
        return Decline("causal_mask", f"probe of {GLOBAL_NAME} raised {type(exc).__name__}: {exc}")
    if eager is not None:
        return Decline("causal_mask", f"{GLOBAL_NAME} builds a {type(eager).__name__} even for unpadded causal "
                                      "inputs eagerly here; leaving it out would change the math")
    return Match("causal_mask", "sdpa", {"global_name": GLOBAL_NAME},
                 evidence=f"{GLOBAL_NAME} returns no mask eagerly for unpadded causal sdpa inputs")


class _CausalMaskOverride:
    """``create_causal_mask`` as this model's forward sees it: ``impl(original, **kwargs, positions_derived=...)``.

    Whether the model derives its position ids itself is a fact about the caller's arguments, which the mask
    function does not see. It is never kept in shared state (two threads running models at once would read each
    other's): the rerouted forward builds one copy of the model's forward per value (``for_call``) and each call
    runs the copy its arguments select (``call_fact``), so the fact is a constant of the function that runs.
    """

    def __init__(self, original: Callable[..., Any], impl: Callable[..., Any], positions_index: int | None, *,
                 positions_derived: bool = False) -> None:
        self.original = original
        self.impl = impl
        self.positions_index = positions_index
        self.positions_derived = positions_derived
        # A forward without position ids never gets any: transformers derives and checks them as it sees fit.
        self.call_facts: tuple[bool, ...] = (False, True) if positions_index is not None else (False,)

    def call_fact(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the model's caller passed no position ids (the forward's own arguments, after self)."""
        index = self.positions_index
        if index is None:
            return False
        passed = kwargs.get("position_ids") is not None or (len(args) > index and args[index] is not None)
        return not passed

    def for_call(self, positions_derived: bool) -> _CausalMaskOverride:
        return _CausalMaskOverride(self.original, self.impl, self.positions_index,
                                   positions_derived=positions_derived)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(self.original, *args, positions_derived=self.positions_derived, **kwargs)


def _positions_index(module: nn.Module) -> int | None:
    """Where ``position_ids`` sits among the forward's positional parameters (after self), if it takes one."""
    names = list(inspect.signature(plain_class_forward(module)).parameters)[1:]
    return names.index("position_ids") if "position_ids" in names else None


def adapt_causal_mask(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict
                      ) -> Callable[..., Any]:
    """The replacement for ``create_causal_mask`` inside this module's forward.

    It calls ``impl(original, *args, positions_derived=..., **kwargs)``, ``positions_derived`` telling whether
    this call of the model was given no position ids: the model then derives ``0..S-1`` itself, which are never
    packed sequences, a fact the kernel could not read from the tensor without reading its values.
    """
    original = plain_class_forward(module).__globals__[match.params["global_name"]]
    return _CausalMaskOverride(original, impl, _positions_index(module))
