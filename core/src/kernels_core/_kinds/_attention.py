"""Sliding-window attention: the attention function a sliding-window layer looks up, rerouted per instance.

transformers' attention modules fetch their function from the ``ALL_ATTENTION_FUNCTIONS`` registry by the
config's ``_attn_implementation``. For a sliding-window layer (Gemma-2/3, Qwen2's sliding layers) SDPA receives a
dense ``[B, 1, S, S]`` band mask, and its fused kernels compute every score of the square before masking: at
4096 tokens and a 1024-token window three quarters of that work is thrown away. A kernel of this kind replaces
the registry's ``"sdpa"`` entry in this module's forward only; other implementations and modules are untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from .._types import Decline
from .._types import Match
from ._context import MatchContext
from ._context import plain_class_forward
from ._context import reroute_blocker


__all__ = [
    "GLOBAL_NAME",
    "Registry",
    "adapt_sliding_window_attention",
    "match_sliding_window_attention",
    "sdpa_registry_problem",
    "uses_attention_registry",
]

GLOBAL_NAME = "ALL_ATTENTION_FUNCTIONS"
_KIND = "sliding_window_attention"


def uses_attention_registry(module: nn.Module) -> bool:
    """Whether the module's class forward looks its attention function up in ``ALL_ATTENTION_FUNCTIONS``."""
    code = getattr(plain_class_forward(module), "__code__", None)
    return code is not None and GLOBAL_NAME in code.co_names


def sdpa_registry_problem(module: nn.Module) -> str | None:
    """Why a module that looks its attention function up in the registry cannot have its causal ``"sdpa"`` entry
    rerouted per instance, or None if it can."""
    blocker = reroute_blocker(module, GLOBAL_NAME, function=False)
    if blocker:
        return blocker
    registry = plain_class_forward(module).__globals__[GLOBAL_NAME]
    if not hasattr(registry, "get_interface") or "sdpa" not in registry:
        return f"{GLOBAL_NAME} is {type(registry).__qualname__}, not transformers' attention registry"
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return f"attention implementation is {implementation!r}; the kernel replaces 'sdpa' only"
    # The kernels skip keys after each query; that holds only where no query attends to a later token.
    if not getattr(module, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return "the attention is bidirectional; later keys may be attended"
    return None


def match_sliding_window_attention(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Causal attention modules with a ``sliding_window`` that look their function up in transformers' registry."""
    window = getattr(module, "sliding_window", None)
    if not uses_attention_registry(module) or window is None:
        return None
    problem = sdpa_registry_problem(module)
    if problem:
        return Decline(_KIND, problem)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return Decline(_KIND, f"sliding_window is {window!r}, not a positive number of tokens")
    if getattr(ctx.config, "vision_config", None) is not None:
        return Decline(_KIND, "a multimodal model: image tokens attend to later tokens of their image, which the "
                              "band kernel would skip")
    return Match(_KIND, "sdpa", {"global_name": GLOBAL_NAME, "window": window},
                 evidence=f"sdpa attention over a {window}-token causal window")


class Registry:
    """``ALL_ATTENTION_FUNCTIONS`` as one module's forward sees it: ``"sdpa"`` is the kernel, the rest unchanged."""

    def __init__(self, original: Any, sdpa: Callable[..., Any]) -> None:
        self.original = original
        self.sdpa = sdpa

    def get_interface(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return self.sdpa if name == "sdpa" else self.original.get_interface(name, default)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self.sdpa if name == "sdpa" else self.original[name]

    def __contains__(self, name: object) -> bool:
        return name in self.original


def adapt_sliding_window_attention(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict
                                   ) -> Registry:
    """The registry this module's forward sees: its ``"sdpa"`` entry calls ``impl(sdpa, module, query, ...)``,
    ``sdpa`` being transformers' own function, which the kernel calls for the parts it computes."""
    original = plain_class_forward(module).__globals__[match.params["global_name"]]
    return Registry(original, functools.partial(impl, original["sdpa"]))
