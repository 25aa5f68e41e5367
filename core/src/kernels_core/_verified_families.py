"""The transformers families kernels-core is verified on, and the layer kinds each one must match.

``core/tests/kinds/test_families.py`` checks these matches on every commit against the newest transformers on
PyPI, but a user's transformers can be newer still. When a matcher cannot read one of these modules' code at all
(``Decline(..., unrecognized=True)``: usually a transformers release that reshaped the forward), the model quietly
loses that kernel, and with the fused loss the full logits come back (gigabytes at a 150k vocabulary). So kernelize
warns once per class, kind and reason; the report has the reason per module.

Example:
    >>> from transformers.models.llama.modeling_llama import LlamaForCausalLM
    >>> family(LlamaForCausalLM), "llama" in VERIFIED["causal_lm_loss"]
    ('llama', True)
"""

from __future__ import annotations

import sys

from ._plugins._fallbacks import warn_fallback
from ._plugins._records import PluginInfo
from ._types import Decline


__all__ = ["VERIFIED", "family", "warn_if_verified"]

_PRE_NORM = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma"})

# kind -> transformers model folders (transformers.models.<folder>) whose modules of that kind the tests match.
VERIFIED: dict[str, frozenset[str]] = {
    "causal_lm_loss": _PRE_NORM | {"gemma2", "gemma3", "phi3"},
    "residual_rms_norm": _PRE_NORM,
}


def family(cls: type) -> str | None:
    """The transformers model folder a class is defined in (``"llama"`` for ``LlamaForCausalLM``), or None."""
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else None


def warn_if_verified(module: object, module_name: str, decline: Decline, plugin: PluginInfo) -> None:
    """Warn once if ``decline`` says the matcher could not read the code of a module kernels-core is verified on."""
    cls = type(module)
    if not decline.unrecognized or family(cls) not in VERIFIED.get(decline.kind, ()):
        return
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", "?")
    warn_fallback(plugin, f"kind:{decline.kind}", f"{cls.__qualname__}: {decline.reason}",
                  f"{cls.__qualname__} ({module_name or 'the model'}) gets no {decline.kind} kernel: kernels-core "
                  f"is verified to match it, but not the code this transformers ({version}) has: "
                  f"{decline.reason}. The module runs its own forward; a kernels-core release that supports this "
                  "transformers matches it again (see the report for every module)")
