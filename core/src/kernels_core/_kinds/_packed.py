"""Packed rows: causal attention per document, computed without the dense mask transformers builds for it.

Several documents packed into one row (TRL ``padding_free``, ``DataCollatorWithFlattening``, LLaMA-Factory's
``neat_packing``, axolotl sample packing) reach a transformers attention module with a dense ``[B, 1, S, S]`` mask
that lets each token see only the earlier tokens of its own document (transformers builds it from restarting
position ids when there is no cache; LLaMA-Factory builds it from segment ids). SDPA then leaves its FlashAttention
and cuDNN kernels and computes every score of the square. A kernel of this kind computes the same attention from
the documents' boundaries alone: FlashAttention's variable-length kernel on CUDA, one causal SDPA call per document
elsewhere.

The kernel runs only where it computes what SDPA computes with that mask: the adapter reads the documents off the
mask (a token starts a document where it cannot see the token before it) and checks that the mask is exactly causal
per document, or exactly that within a sliding window, before calling it. Any other mask (padding, a custom mask, a
cache that lets documents see each other, no mask at all), and a batch of one document a row (an unpacked batch: a
sliding-window layer's band mask), goes to the attention function the module had. The check
costs one pass over the mask and two small device-to-host reads per mask (where documents start; the verdict with
the offsets), not per layer: its result is kept on the mask tensor itself, which every layer of one forward shares,
and the offsets as Python ints on ``cu_seqlens`` (``kernels_core.portable.document_bounds``).

Kernels of this kind follow this calling convention::

    impl(query, key, value, *, cu_seqlens, max_seqlen, scale, window) -> output

``query`` is ``[T, Hq, D]``, ``key`` and ``value`` ``[T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``: grouped-query
attention, keys and values not repeated), the documents of every row laid end to end; ``cu_seqlens`` the
``int32`` offsets of the ``N`` documents (``N + 1`` values, on the tensors' device), ``max_seqlen`` the longest
document's length, ``scale`` the factor applied to the scores, ``window`` ``None`` (causal) or the number of tokens
a query sees counting itself (a key ``j`` is seen by query ``i`` of the same document where ``0 <= i - j < window``).
The output is ``[T, Hq, D]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._portable._packed_attention import remember_bounds
from .._types import Decline
from .._types import Match
from .._types import Mode
from ._attention import GLOBAL_NAME
from ._attention import Registry
from ._attention import sdpa_registry_problem
from ._attention import uses_attention_registry
from ._context import MatchContext
from ._context import plain_class_forward


__all__ = ["Documents", "adapt_packed_attention", "documents_of", "masked_sdpa", "match_packed_attention"]

_KIND = "packed_attention"
# Keyword arguments transformers' sdpa_attention_forward reads and the kernel does not reproduce: the call then goes
# to the module's own attention function (which raises for softcap, warns for output_attentions).
_NOT_REPRODUCED = ("position_bias", "softcap", "s_aux", "sinks")
# Where the verdict on a mask is kept: on the mask tensor, which lives as long as the forward that built it.
_MEMO_ATTR = "_kernels_core_documents"
# Elements of each boolean block of the mask check: 64 MiB, a fraction of the [S, S] mask it reads at long rows.
_CHECK_ELEMENTS = 1 << 26


def match_packed_attention(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Causal attention modules that look their function up in transformers' registry and run ``"sdpa"``."""
    if not uses_attention_registry(module):
        return None
    problem = sdpa_registry_problem(module)
    if problem:
        return Decline(_KIND, problem)
    if ctx.mode is not None and Mode.TORCH_COMPILE in ctx.mode:
        if Mode.TRAINING not in ctx.mode:
            # Decoding steps bring a mask and a cache, which the kernel never takes; a bound attention function
            # would only add guards that Dynamo checks on every step.
            return Decline(_KIND, "under torch.compile for inference the traced mask stays with sdpa (packed rows "
                                  "are a training layout; decoding steps would only pay the binding's guards)")
        # A traced graph cannot read the documents off the mask (a host read of its values), so under
        # torch.compile the kernel takes the mask itself and skips the tiles it hides.
        return Match(_KIND, "masked", {"global_name": GLOBAL_NAME},
                     evidence="sdpa attention under torch.compile: a call with a boolean mask (packed rows, "
                              "padding) computes the same masked attention skipping the key blocks the mask hides; "
                              "calls without a mask go to sdpa as before")
    window = getattr(module, "sliding_window", None)
    windowed = isinstance(window, int) and not isinstance(window, bool)
    evidence = ("sdpa attention: where its mask is exactly causal per document (packed rows"
                + (f", within a {window}-token window" if windowed else "")
                + "), each document is computed without the dense mask; any other mask goes to sdpa as before")
    return Match(_KIND, "sliding_window" if windowed else "causal", {"global_name": GLOBAL_NAME}, evidence=evidence)


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch, as a mask that is causal per document describes them.

    ``cu_seqlens`` holds the ``int32`` offsets of the documents of all rows laid end to end (on the mask's
    device), ``max_seqlen`` the longest one's length.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """The boolean ``[B, S, S]`` pattern of what each query sees, or None if the mask is not a pattern."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    if mask.dtype == torch.bool:
        return mask[:, 0]
    if not mask.is_floating_point():
        return None
    # An additive mask: 0 where seen, the dtype's lowest value (or -inf) where not. Anything else is a bias.
    lowest = torch.finfo(mask.dtype).min
    if not bool(((mask == 0) | (mask <= lowest)).all()):
        return None
    return mask[:, 0] == 0


def documents_of(mask: torch.Tensor, *, window: int | None, batch: int) -> Documents | None:
    """The documents a mask is exactly causal over (within ``window`` tokens, if given), or None.

    Example:
        >>> import torch
        >>> i = torch.arange(5)
        >>> doc = torch.tensor([0, 0, 0, 1, 1])
        >>> mask = ((i[:, None] >= i[None]) & (doc[:, None] == doc[None]))[None, None]
        >>> documents_of(mask, window=None, batch=1).cu_seqlens.tolist()
        [0, 3, 5]
        >>> documents_of(torch.ones(1, 1, 5, 5, dtype=torch.bool), window=None, batch=1) is None
        True
    """
    allowed = _allowed(mask)
    if allowed is None or allowed.shape[0] not in (1, batch):
        return None
    length = allowed.shape[-1]
    # A token starts a document where it cannot see the token before it; the first token of a row always does.
    starts = torch.ones(allowed.shape[0], length, dtype=torch.bool, device=mask.device)
    if length > 1:
        starts[:, 1:] = ~allowed.diagonal(offset=-1, dim1=-2, dim2=-1)
    document = starts.cumsum(-1)
    index = torch.arange(length, device=mask.device)
    same = torch.ones((), dtype=torch.bool, device=mask.device)
    # The expected pattern is built a block of query rows at a time, from boolean comparisons only: at 32,768
    # tokens a row, one [S, S] tensor of int64 distances would be 8 GiB, on top of the mask transformers built.
    rows = max(1, _CHECK_ELEMENTS // (allowed.shape[0] * length))
    for first in range(0, length, rows):
        query = index[first:first + rows, None]
        expected = (document[:, first:first + rows, None] == document[:, None, :]) & (index <= query)
        if window is not None:
            expected &= index > query - window
        same &= (expected == allowed[:, first:first + rows]).all()
    starts = starts.expand(batch, length).reshape(-1)
    offsets = torch.cat([starts.nonzero().flatten(), torch.tensor([batch * length], device=mask.device)])
    # One device-to-host copy for the verdict and the offsets: the host needs the longest document's length, and a
    # kernel that takes the offsets as Python ints (the portable one) finds them kept on cu_seqlens.
    same, *bounds = torch.cat([same.long().reshape(1), offsets]).tolist()
    if not same:
        return None
    cu_seqlens = offsets.to(torch.int32)
    remember_bounds(cu_seqlens, bounds)
    return Documents(cu_seqlens=cu_seqlens, max_seqlen=max(b - a for a, b in zip(bounds, bounds[1:], strict=False)))


def _memoized_documents(mask: torch.Tensor, *, window: int | None, batch: int) -> Documents | None:
    memo = mask.__dict__.setdefault(_MEMO_ATTR, {})
    key = (window, batch, mask._version)
    if key not in memo:
        memo[key] = documents_of(mask, window=window, batch=batch)
    return memo[key]


def _window(sliding_window: object) -> int | None:
    # transformers passes the layer's window (or None) with every call of a sliding-window family.
    return sliding_window if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) else None


def _reproduced(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the kernels compute this sdpa_attention_forward call: no dropout, no is_causal override, nothing of
    _NOT_REPRODUCED, no attention weights asked for."""
    dropout = kwargs.get("dropout", args[0] if args else 0.0)
    return not (len(args) > 2 or dropout or kwargs.get("output_attentions")
                or any(kwargs.get(name) is not None for name in _NOT_REPRODUCED))


def _scale(args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> float:
    scale = kwargs.get("scaling", args[1] if len(args) > 1 else None)
    return float(dim ** -0.5 if scale is None else scale)


def packed_sdpa(sdpa: Callable[..., Any], impl: Callable[..., Any], /, module: nn.Module, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward``, with ``impl`` computing the calls whose mask is causal per
    document; ``sdpa`` (the function the module had) computes every other call."""
    def fallback() -> tuple[torch.Tensor, Any]:
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    if (attention_mask is None or not isinstance(attention_mask, torch.Tensor) or not _reproduced(args, kwargs)
            or torch.compiler.is_compiling()):
        return fallback()
    batch, heads, length, dim = query.shape
    if key.shape[-2] != length or value.shape[-1] != dim or heads % key.shape[1]:
        return fallback()
    window = _window(kwargs.get("sliding_window"))
    documents = _memoized_documents(attention_mask, window=window, batch=batch)
    if documents is None and window is not None:
        # A family that passes its window to every layer, the mask of full-attention layers being causal.
        documents = _memoized_documents(attention_mask, window=None, batch=batch)
        window = None
    if documents is None or documents.cu_seqlens.shape[0] == batch + 1:
        # No mask that fits, or one document a row: an unpacked batch (a sliding-window layer's band mask), which
        # the function the module had computes as it always did.
        return fallback()
    # [B, H, S, D] -> [B * S, H, D]: the documents of every row end to end.
    out = impl(query.transpose(1, 2).reshape(batch * length, heads, dim),
               key.transpose(1, 2).reshape(batch * length, key.shape[1], dim),
               value.transpose(1, 2).reshape(batch * length, value.shape[1], dim),
               cu_seqlens=documents.cu_seqlens, max_seqlen=documents.max_seqlen, scale=_scale(args, kwargs, dim),
               window=window)
    # sdpa_attention_forward returns [batch, queries, heads, head_dim].
    return out.view(batch, length, heads, dim), None


def masked_sdpa(sdpa: Callable[..., Any], impl: Callable[..., Any], /, module: nn.Module, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward``, with ``impl`` computing the calls that bring a boolean mask
    (the ``masked`` variant, under torch.compile); ``sdpa`` computes every other call.

    Only static facts decide (a trace may not branch on data): a boolean ``[B or 1, 1, S, S]`` mask, as many keys
    as queries, nothing sdpa_attention_forward reads that the kernel does not reproduce.
    """
    batch, heads, length, dim = query.shape
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool
            or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
            or attention_mask.shape[0] not in (1, batch) or attention_mask.shape[-2:] != (length, length)
            or key.shape[-2] != length or heads % key.shape[1] or not _reproduced(args, kwargs)):
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    out = impl(query, key, value, mask=attention_mask[:, 0], scale=_scale(args, kwargs, dim))
    # sdpa_attention_forward returns [batch, queries, heads, head_dim].
    return out.transpose(1, 2).contiguous(), None


def adapt_packed_attention(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict, *,
                           base: Any = None) -> Registry:
    """The registry this module's forward sees: its ``"sdpa"`` entry is :func:`packed_sdpa` over the entry it had.

    ``base`` is the registry another kind already put in this module's forward (the sliding-window kernel), whose
    ``"sdpa"`` then computes the calls that are not packed; otherwise transformers' own registry.
    """
    original = base if base is not None else plain_class_forward(module).__globals__[match.params["global_name"]]
    fn = masked_sdpa if match.variant == "masked" else packed_sdpa
    return Registry(original, functools.partial(fn, original["sdpa"], impl))
