"""No causal mask under ``torch.compile`` where transformers builds none eagerly, so SDPA runs ``is_causal``.

Eagerly, transformers' ``create_causal_mask`` returns ``None`` for unpadded causal inputs with an empty cache, and
SDPA then runs its causal kernels. While Dynamo traces the same call it may build a dense ``[B, 1, S, S]`` mask
instead (transformers 5.17 always; 5.23 on torch 2.11; any version without a cache), and SDPA computes every
score. This kernel returns ``None`` while tracing when that is provably what the eager call returns, judging from
facts fixed at trace time only (which arguments are None, the attention implementation, the cache's length): no
tensor value is read, so the graph has no break and no guard on data. Everything else is handed to transformers'
function unchanged, except position ids the model derived itself: those are never packed, and checking them for
packing would read a device value (a host sync) every training step.

Example:
    >>> from kernels_core._portable._causal_mask import sdpa_is_causal
    >>> sdpa_is_causal(lambda **kwargs: "built by transformers", config=None, attention_mask=None,
    ...                positions_derived=True)
    'built by transformers'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


__all__ = ["sdpa_is_causal"]

# Arguments that cannot make a mask necessary when they are None (or absent). Anything else given changes the
# mask (extra mask functions, block ids, a disabled skip) and goes to transformers.
_NEUTRAL_WHEN_NONE = frozenset({"attention_mask", "or_mask_function", "and_mask_function", "block_sequence_ids",
                                "layer_idx", "cache_position", "encoder_hidden_states"})
# The KV cache is `cache` from transformers 5.24 on, `past_key_values` before.
_CACHE_NAMES = ("cache", "past_key_values")
_ALWAYS_NEUTRAL = frozenset({"config", "inputs_embeds", "position_ids", *_CACHE_NAMES})


def _empty_cache(cache: object) -> bool:
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        return False
    seen = length()
    # A Python int only: a tensor or symbolic length would need its value read, which a trace must not do.
    return type(seen) is int and seen == 0


def _cache(kwargs: dict[str, Any]) -> object | None:
    return next((kwargs[name] for name in _CACHE_NAMES if kwargs.get(name) is not None), None)


def _elidable(kwargs: dict[str, Any], *, positions_derived: bool) -> bool:
    config = kwargs.get("config")
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(config, "is_causal", True):
        return False
    if kwargs.get("allow_is_causal_skip", True) is not True:
        return False
    if any(value is not None for key, value in kwargs.items() if key in _NEUTRAL_WHEN_NONE):
        return False
    if any(key not in _NEUTRAL_WHEN_NONE | _ALWAYS_NEUTRAL | {"allow_is_causal_skip"} for key in kwargs):
        return False
    cache = _cache(kwargs)
    if cache is None:
        # Without a cache transformers checks position_ids for packed sequences (which need a block mask): only
        # positions the model derived itself (its caller passed none) are known to be unpacked.
        return positions_derived or kwargs.get("position_ids") is None
    return _empty_cache(cache)


def _checks_packing(kwargs: dict[str, Any]) -> bool:
    # When transformers looks for packed sequences in the position ids: given positions, no mask, no cache.
    return (kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None
            and _cache(kwargs) is None)


def sdpa_is_causal(create_causal_mask: Callable[..., Any], /, *args: Any, positions_derived: bool = False,
                   **kwargs: Any) -> Any:
    """``create_causal_mask(*args, **kwargs)``, or ``None`` while tracing where the eager call returns ``None``.

    Follows the ``causal_mask`` convention: the first argument is transformers' own function, the rest are the
    arguments the model's forward passed to it, and ``positions_derived`` says that the model's caller gave no
    position ids. Positional calls always go to transformers.

    Positions the model derived itself (``0..S-1``) are never packed sequences, so transformers does not get them
    to check: without a cache (every training forward with the fused loss) that check reads a device value, a
    host sync that drains the GPU's queue once per step, and its result is known (no packing, the same mask).
    """
    if args:
        return create_causal_mask(*args, **kwargs)
    if torch.compiler.is_compiling() and _elidable(kwargs, positions_derived=positions_derived):
        return None
    if positions_derived and _checks_packing(kwargs):
        kwargs = {**kwargs, "position_ids": None}
    return create_causal_mask(**kwargs)
