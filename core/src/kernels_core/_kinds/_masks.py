"""The causal attention mask a transformers base model builds, rerouted per instance like ``apply_rotary_pos_emb``.

transformers' ``create_causal_mask`` returns no mask at all for unpadded causal inputs, so that SDPA runs its
``is_causal`` kernels (FlashAttention, cuDNN), which skip the masked half of the scores. While ``torch.compile``
traces it with torch < 2.14, though, ``torch.compiler.is_exporting()`` reads as true inside Dynamo, transformers
then refuses that shortcut, and every compiled layer gets a dense ``[B, 1, S, S]`` mask: SDPA computes the whole
square and the compiled model's attention ran 2.5x slower than eager's on an H200 (``attention_bench.py``,
``qwen3_bench.py --profile``). A kernel of this kind decides, from static facts only, when the mask can be
left out under tracing exactly as it is eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import Decline
from .._types import Match
from ._context import MatchContext
from ._context import plain_class_forward
from ._rotary import reroute_blocker


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
            eager = fn(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                       position_ids=torch.arange(4, device=device)[None])
    except Exception as exc:  # noqa: BLE001 - an unknown signature: leave the model alone
        return Decline("causal_mask", f"probe of {GLOBAL_NAME} raised {type(exc).__name__}: {exc}")
    if eager is not None:
        return Decline("causal_mask", f"{GLOBAL_NAME} builds a {type(eager).__name__} even for unpadded causal "
                                      "inputs eagerly here; leaving it out would change the math")
    return Match("causal_mask", "sdpa", {"global_name": GLOBAL_NAME},
                 evidence=f"{GLOBAL_NAME} returns no mask eagerly for unpadded causal sdpa inputs")


def adapt_causal_mask(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict
                      ) -> Callable[..., Any]:
    """The replacement for ``create_causal_mask`` inside this module's forward: ``impl(original, **kwargs)``."""
    original = plain_class_forward(module).__globals__[match.params["global_name"]]

    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        return impl(original, *args, **kwargs)

    return create_causal_mask
