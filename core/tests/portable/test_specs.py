"""The portable kernels' declarations: valid, cheap to list, and pointing at the right calling conventions."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
from kernels_core import KernelSpec
from kernels_core import Supports
from kernels_core._portable import SPECS


def test_specs_are_portable_lowest_priority_and_unique():
    assert SPECS and all(isinstance(spec, KernelSpec) for spec in SPECS)
    assert len({spec.id for spec in SPECS}) == len(SPECS)
    for spec in SPECS:
        # The fused residual + norm is CPU-only: elsewhere it would displace a backend's own RMSNorm kernel.
        assert spec.portable or spec.id == "cpu.residual_rms_norm.recompute"
        assert spec.priority < 100  # vendor kernels start at 100 and must win
        assert spec.supports & Supports.BACKWARD


def test_listing_imports_no_torch():
    code = "import sys, kernels_core._portable as p; p.SPECS; print(sorted(m for m in sys.modules if 'torch' in m))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# Positional parameters and keyword-only options each kind's convention passes (core/docs/kernel-conventions.md).
CONVENTIONS = {
    "causal_lm_loss": (
        ["hidden_states", "weight", "labels"],
        {"bias", "ignore_index", "num_items_in_batch", "softcap"},
    ),
    "rms_norm": (["hidden_states", "weight"], {"eps", "offset", "casting"}),
    "residual_rms_norm": (["hidden_states", "residual", "weight"], {"eps", "offset", "casting"}),
    "silu_gated_mlp": (["gate", "up"], set()),
    # transformers' create_causal_mask comes first (positional-only), then whatever the model passed to it.
    "causal_mask": ([], set()),
    # transformers' sdpa_attention_forward comes first (positional-only), then the attention module's call.
    "sliding_window_attention": (["module", "query", "key", "value", "attention_mask"], {"sliding_window"}),
    "packed_attention": (["query", "key", "value"], {"cu_seqlens", "max_seqlen", "scale", "window"}),
    # The variant traced by torch.compile takes the mask itself (its values cannot be read while tracing).
    ("packed_attention", "masked"): (["query", "key", "value"], {"mask", "scale"}),
}


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.id)
def test_impl_follows_its_kind_convention(spec):
    module_name, attr = spec.impl.split(":")
    fn = getattr(importlib.import_module(module_name), attr)
    positional, keywords = CONVENTIONS.get((spec.kind, *spec.variants), CONVENTIONS[spec.kind])
    params = inspect.signature(fn).parameters
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert keywords <= {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
