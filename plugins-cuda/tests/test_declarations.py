"""Declarations: valid, unique, lazy, and the mode-dependent choice they encode."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest
from kernels_core import Mode
from kernels_core.plugin import Supports
from kernels_cuda import _plugin
from kernels_cuda import cuda_kernel_specs


SPECS = cuda_kernel_specs()


def test_ids_unique_and_named_by_backend_kind():
    ids = [s.id for s in SPECS]
    assert len(ids) == len(set(ids))
    assert all(s.backend == "cuda" and s.id.startswith(f"cuda.{s.kind}.") for s in SPECS)
    assert all(s.priority >= 100 for s in SPECS), "vendor kernels use priorities of 100 and above"


def _best(kind, *, compile_mode):
    eligible = [s for s in SPECS if s.kind == kind and (not compile_mode or s.supports & Supports.TORCH_COMPILE)]
    return max(eligible, key=lambda s: s.priority).id if eligible else None


@pytest.mark.parametrize("kind,eager,compiled", [
    ("rms_norm", "cuda.rms_norm.tuned", "cuda.rms_norm.tuned"),
    ("silu_gated_mlp", "cuda.silu_gated_mlp.triton", "cuda.silu_gated_mlp.triton"),
    ("gelu_gated_mlp", "cuda.gelu_gated_mlp.triton", "cuda.gelu_gated_mlp.triton"),
    ("rotary_embedding", "cuda.rotary_embedding.triton", "cuda.rotary_embedding.triton"),
    ("residual_rms_norm", "cuda.residual_rms_norm.tuned", "cuda.residual_rms_norm.tuned"),
    ("layer_norm", "cuda.layer_norm.liger", "cuda.layer_norm.torch"),
    ("causal_lm_loss", "cuda.causal_lm_loss.liger", "cuda.causal_lm_loss.liger"),
    ("moe_experts", "cuda.moe_experts.grouped_mm_silu", "cuda.moe_experts.grouped_mm_silu"),
])
def test_preferred_kernel_per_mode(kind, eager, compiled):
    assert _best(kind, compile_mode=False) == eager
    assert _best(kind, compile_mode=True) == compiled


@pytest.mark.parametrize("variant,expected", [("silu", "cuda.moe_experts.grouped_mm_silu"),
                                              ("gelu_tanh", "cuda.moe_experts.grouped_mm_gelu")])
def test_each_experts_activation_prefers_the_grouped_products(variant, expected):
    # Liger's MoE autotunes for over a minute on first use and has no compile support: it must rank below.
    for compile_mode in (False, True):
        eligible = [s for s in SPECS if s.kind == "moe_experts" and variant in s.variants
                    and (not compile_mode or s.supports & Supports.TORCH_COMPILE)]
        assert max(eligible, key=lambda s: s.priority).id == expected


def test_triton_kernels_require_ampere_and_only_liger_and_fp8_ones_require_a_library():
    for spec in SPECS:
        if spec.id.endswith((".liger", ".tuned", ".triton")):
            assert spec.capability is not None and spec.capability.min == (8, 0), spec.id
        if spec.kind == "linear":
            assert spec.capability is not None and spec.capability.min == (8, 9), spec.id
            assert spec.requires == ("torchao>=0.17,<0.19",), spec.id
        else:
            assert spec.requires == (("liger-kernel>=0.8.5",) if spec.id.endswith(".liger") else ()), spec.id


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_impl_resolves(spec):
    if spec.kind == "linear" and importlib.util.find_spec("torchao") is None:
        pytest.skip("the FP8 kernels' module imports torchao (kernels-cuda[fp8]), not installed here")
    module, attr = spec.impl.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_hooks_return_declarations():
    assert tuple(_plugin.kernels_core_kernels()) == SPECS


def test_entry_module_imports_no_torch_triton_or_liger():
    code = ("import sys, kernels_cuda._plugin as p; p.kernels_core_kernels(); "
            "print(sorted(m for m in ('torch', 'triton', 'liger_kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="kernels_core.plugins")}
    assert eps.get("cuda") == "kernels_cuda._plugin"


def test_only_kernels_that_trace_plain_math_for_inference_are_left_to_compile():
    compiled_inference = Mode.INFERENCE | Mode.TORCH_COMPILE
    left = {s.id for s in SPECS if s.left_to_compiler(compiled_inference)}
    # The fused loss and the grouped-product experts change the compiled graph; everything else compile-safe here
    # hands Inductor the native math when traced with no autograd graph.
    kept = {s.id for s in SPECS if s.supports & Supports.TORCH_COMPILE} - left
    assert kept == {"cuda.causal_lm_loss.liger", "cuda.moe_experts.grouped_mm_silu",
                    "cuda.moe_experts.grouped_mm_gelu", "cuda.linear.float8_rowwise", "cuda.linear.float8_tensorwise"}
    assert {"cuda.rms_norm.tuned", "cuda.residual_rms_norm.tuned", "cuda.rotary_embedding.triton"} <= left
    assert not any(s.left_to_compiler(Mode.TRAINING | Mode.TORCH_COMPILE) for s in SPECS)
