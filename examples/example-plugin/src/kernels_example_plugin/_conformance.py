"""Conformance cases of the ``plain_mlp`` kind, for ``kernels-core check`` and ``kernels_core.testing``.

Each case is a real transformers MLP of odd width (hidden 44, MLP 67) inside a tiny randomly initialised model;
every kernel declared for ``plain_mlp`` must reproduce its forward and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from kernels_core.plugin import ConformanceCase
from kernels_core.testing import tiny_causal_lm
from torch import nn


__all__ = ["cases"]


def _mlp_of(family: str, target: str) -> Any:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str]:
        model = tiny_causal_lm(family, dtype=dtype, hidden_size=44, intermediate_size=67, vocab_size=101)
        return model.to(device), target

    return build


def _inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    weight = next(target.parameters())
    x = torch.randn(2, 7, 44, generator=generator)
    return (x.to(device=weight.device, dtype=weight.dtype),), {}


def cases() -> tuple[ConformanceCase, ...]:
    """Starcoder2's MLP (tanh GELU) and GPT-NeoX's (exact GELU)."""
    return (
        ConformanceCase("gelu_tanh", "Starcoder2MLP", _mlp_of("starcoder2", "model.layers.0.mlp"), _inputs),
        ConformanceCase("gelu", "GPTNeoXMLP", _mlp_of("gpt_neox", "gpt_neox.layers.0.mlp"), _inputs),
    )
