"""The ``attention`` layer kind: a transformers attention module's attention function, rerouted per instance.

transformers attention modules pick their attention function by name,
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)``, and the
config is shared by every layer (and by every model built from it), so switching the name would switch every
module at once. Instead this kind is a ``target="global"`` kind: the core re-creates *one instance's* forward
with its global ``ALL_ATTENTION_FUNCTIONS`` pointing at :class:`NpuAttentionFunctions`, which hands out the NPU
attention function whatever name is asked for. The model config, the masks transformers builds from it, other
instances and other models are untouched, and ``unkernelize`` restores the instance's forward.

Calling convention of the kind (what a kernel implements; see ``kernels_npu._fusion_attention``)::

    fn(query, key, value, *, masked_out, scale, dropout_p, causal) -> Tensor [B, Sq, Hq, D]

with query ``[B, Hq, Sq, D]``, key/value ``[B, Hkv, Skv, D]`` (``Hq % Hkv == 0``), ``masked_out`` ``None`` or a
bool ``[B or 1, 1, Sq, Skv]`` mask where True means masked out, and ``causal`` meaning "bottom-right aligned
causal, no other mask" (flash-attention's convention). :func:`attention_forward` converts whatever mask
transformers built (SDPA bool, eager additive float, flash 2-D padding, or none) to that form.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from kernels_core.plugin import Decline
from kernels_core.plugin import Match
from kernels_core.plugin import MatchContext


__all__ = ["GLOBAL_NAME", "KIND", "NpuAttentionFunctions", "adapt", "attention_forward", "match", "normalize_mask"]

logger = logging.getLogger(__name__)

KIND = "attention"
GLOBAL_NAME = "ALL_ATTENTION_FUNCTIONS"
# npu_fusion_attention's documented head-dim limit.
MAX_HEAD_DIM = 768

AttentionKernel = Callable[..., torch.Tensor]


def _bottom_right_causal(q_len: int, kv_len: int, device: torch.device | None) -> torch.Tensor:
    """``[q_len, kv_len]`` bool, True = masked: query i sits at absolute position ``i + kv_len - q_len``."""
    rows = torch.arange(q_len, device=device).unsqueeze(-1) + (kv_len - q_len)
    return torch.arange(kv_len, device=device).unsqueeze(0) > rows


def normalize_mask(
    attention_mask: object,
    *,
    q_len: int,
    kv_len: int,
    causal: bool,
    sliding_window: int | None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Turn the mask transformers hands an attention function into ``None`` or a bool "True = masked out" mask.

    - ``None``: transformers decided no explicit mask is needed (plain causal, or a single decoding query); only
      a sliding window narrower than the keys still needs one, built here.
    - 4-D bool (SDPA's, True = attend): inverted.
    - 4-D float (eager's additive mask, 0 = attend, a large negative value = masked): nonzero is masked. Only
      binary additive masks are meaningful to a masking kernel; the model families matched here build no others.
    - 2-D ``[B, Skv]`` (flash-attention's padding mask, 1 = token): combined with the causal pattern.

    Example:
        >>> import torch
        >>> normalize_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), q_len=2, kv_len=2, causal=True,
        ...                sliding_window=None).any().item()
        False
    """
    if attention_mask is None:
        if causal and sliding_window is not None and kv_len > sliding_window and q_len > 0:
            masked = _bottom_right_causal(q_len, kv_len, device)
            rows = torch.arange(q_len, device=device).unsqueeze(-1) + (kv_len - q_len)
            masked |= torch.arange(kv_len, device=device).unsqueeze(0) <= rows - sliding_window
            return masked[None, None]
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"NPU attention got a {type(attention_mask).__name__} mask; it accepts tensor masks only "
            "(load the model with attn_implementation='sdpa' or 'eager', not 'flex_attention')"
        )
    if attention_mask.dim() == 2:
        padded = attention_mask[:, :kv_len] == 0
        masked = padded[:, None, None, :].expand(padded.shape[0], 1, q_len, kv_len)
        if causal and q_len > 1:
            masked = masked | _bottom_right_causal(q_len, kv_len, attention_mask.device)
        return masked
    if attention_mask.dim() != 4:
        raise ValueError(f"NPU attention: unsupported mask shape {tuple(attention_mask.shape)}; expected 2-D or 4-D")
    attention_mask = attention_mask[..., :kv_len]
    masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    return masked.expand(masked.shape[0], masked.shape[1], q_len, kv_len)


def attention_forward(
    kernel: AttentionKernel,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (same arguments and ``(output, weights)`` result) calling ``kernel``."""
    if softcap is not None:
        raise ValueError("NPU attention does not support attention logit softcapping (npu_fusion_attention has none)")
    if kwargs.get("s_aux") is not None:
        raise ValueError("NPU attention does not support attention sinks")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q_len, kv_len = query.shape[2], key.shape[2]
    masked_out = normalize_mask(
        attention_mask, q_len=q_len, kv_len=kv_len, causal=causal, sliding_window=sliding_window, device=query.device
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kernel(query, key, value, masked_out=masked_out, scale=scale, dropout_p=dropout, causal=causal)
    return out, None


class NpuAttentionFunctions:
    """Stands in for ``ALL_ATTENTION_FUNCTIONS`` inside one module's forward: every lookup gives the NPU function.

    Example:
        >>> funcs = NpuAttentionFunctions(my_kernel)  # doctest: +SKIP
        >>> funcs.get_interface("sdpa", eager_attention_forward)(module, q, k, v, mask)  # doctest: +SKIP
    """

    def __init__(self, kernel: AttentionKernel) -> None:
        self.kernel = kernel

    def _forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return attention_forward(self.kernel, *args, **kwargs)

    def get_interface(self, attn_implementation: str | None, default: Callable[..., Any]) -> Callable[..., Any]:
        return self._forward

    def __getitem__(self, attn_implementation: str) -> Callable[..., Any]:
        return self._forward

    def get(self, attn_implementation: str, default: object = None) -> Callable[..., Any]:
        return self._forward

    def __contains__(self, attn_implementation: object) -> bool:
        return True

    def __repr__(self) -> str:
        return f"NpuAttentionFunctions({getattr(self.kernel, '__qualname__', self.kernel)!r})"


def match(module: torch.nn.Module, qualified_name: str, ctx: MatchContext) -> Match | Decline | None:
    """Match transformers attention modules whose forward picks its function from ``ALL_ATTENTION_FUNCTIONS``.

    Purely structural, on purpose: the kernel replaces only the attention function, whose contract (q/k/v in,
    ``[B, S, H, D]`` out, mask, scaling, dropout) transformers defines for every registered implementation, so
    there is no model math to probe. Declines what ``npu_fusion_attention`` cannot compute.
    """
    forward = getattr(type(module), "forward", None)
    # Read the code under decorators (transformers 5.24 wraps forwards to rename deprecated keywords).
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if code is None or GLOBAL_NAME not in code.co_names or "get_interface" not in code.co_names:
        return None
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    if softcap is not None:
        return Decline(KIND, f"attention logit softcapping ({softcap}) is not supported by npu_fusion_attention")
    if getattr(module, "sinks", None) is not None:
        return Decline(KIND, "attention sinks are not supported by npu_fusion_attention")
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > MAX_HEAD_DIM:
        return Decline(KIND, f"head_dim {head_dim} exceeds npu_fusion_attention's limit of {MAX_HEAD_DIM}")
    causal = bool(getattr(module, "is_causal", True))
    return Match(
        kind=KIND,
        variant="causal" if causal else "bidirectional",
        params={"global_name": GLOBAL_NAME},
        evidence=f"{type(module).__name__}.forward calls {GLOBAL_NAME}.get_interface",
    )


def adapt(module: torch.nn.Module, match: Match, impl: AttentionKernel, options: dict[str, object]) -> object:
    """The replacement for ``ALL_ATTENTION_FUNCTIONS`` in this module's forward."""
    return NpuAttentionFunctions(impl)
