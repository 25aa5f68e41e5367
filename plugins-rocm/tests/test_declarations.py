"""Declarations: valid, reusing the shared adapters, with per-architecture constraints and stated priorities."""

from __future__ import annotations

import importlib
import re

import pytest
from kernels_core.plugin import Supports
from kernels_rocm import rocm_kernel_specs
from kernels_rocm._archs import CDNA
from kernels_rocm._archs import LIGER_CI_ARCHS
from kernels_rocm._archs import LIGER_GEMM_ARCHS
from kernels_rocm._archs import LIGER_ROW_ARCHS
from kernels_rocm._archs import RDNA
from kernels_rocm._declarations import LIGER_ARCHS
from kernels_rocm._declarations import NATIVE_EXCLUDED
from kernels_rocm._declarations import TRITON_ARCHS
from kernels_triton import LIGER_ADAPTERS
from kernels_triton import NATIVE_ADAPTERS
from kernels_triton import TRITON_ADAPTERS


SPECS = rocm_kernel_specs()
BY_ID = {s.id: s for s in SPECS}
LIGER = [s for s in SPECS if s.id.endswith(".liger")]
NATIVE = [s for s in SPECS if s.id.endswith(".torch")]
TRITON = [s for s in SPECS if s.id.endswith(".triton")]


def test_ids_unique_and_named_by_backend_kind():
    ids = [s.id for s in SPECS]
    assert len(ids) == len(set(ids))
    assert all(s.backend == "rocm" and s.id.startswith(f"rocm.{s.kind}.") for s in SPECS)
    assert len(LIGER) + len(NATIVE) + len(TRITON) == len(SPECS)
    assert all(s.priority >= 100 for s in SPECS), "vendor kernels use priorities of 100 and above"


def test_every_shared_liger_adapter_is_reviewed_for_amd():
    # A new shared adapter must get an explicit ROCm architecture decision before it is declared here.
    assert set(LIGER_ARCHS) == set(LIGER_ADAPTERS)
    assert set(TRITON_ARCHS) == set(TRITON_ADAPTERS)
    assert {s.kind for s in LIGER} == set(LIGER_ADAPTERS)
    assert {s.kind for s in NATIVE} == set(NATIVE_ADAPTERS) - set(NATIVE_EXCLUDED)
    assert {s.kind for s in TRITON} == set(TRITON_ADAPTERS)


def test_implementations_are_the_shared_adapters_not_copies():
    for spec in LIGER:
        assert spec.impl == LIGER_ADAPTERS[spec.kind].impl
    for spec in NATIVE:
        assert spec.impl == NATIVE_ADAPTERS[spec.kind].impl
    for spec in TRITON:
        assert spec.impl == TRITON_ADAPTERS[spec.kind].impl
    assert all(s.impl.startswith("kernels_triton.") for s in SPECS)


def test_supports_flags_are_the_shared_adapters_own():
    # Backward and torch.compile support are properties of the adapter code, identical on both GPU plugins.
    for spec in LIGER:
        assert spec.supports == LIGER_ADAPTERS[spec.kind].supports, spec.id
    for spec in NATIVE:
        assert spec.supports == NATIVE_ADAPTERS[spec.kind].supports, spec.id
    for spec in TRITON:
        assert spec.supports == TRITON_ADAPTERS[spec.kind].supports, spec.id


def test_liger_kernels_are_constrained_per_architecture():
    for spec in LIGER:
        assert spec.archs, f"{spec.id} must name the gfx architectures it runs on"
        assert set(spec.archs) <= set(LIGER_ROW_ARCHS)
        assert spec.requires == ("liger-kernel>=0.8.5",)
    assert BY_ID["rocm.moe_experts.liger"].archs == LIGER_GEMM_ARCHS == CDNA
    assert not set(BY_ID["rocm.moe_experts.liger"].archs) & set(RDNA)
    for kind in ("rms_norm", "layer_norm", "silu_gated_mlp", "gelu_gated_mlp", "rotary_embedding",
                 "causal_lm_loss"):
        assert BY_ID[f"rocm.{kind}.liger"].archs == CDNA + RDNA


def test_own_triton_kernels_are_row_wise_and_need_no_distribution():
    for spec in TRITON:
        assert spec.archs == LIGER_ROW_ARCHS and spec.requires == (), spec.id


def test_arch_names_are_bare_gfx_names_and_include_liger_ci():
    assert all(re.fullmatch(r"gfx[0-9a-f]+", arch) for arch in LIGER_ROW_ARCHS)
    assert len(set(LIGER_ROW_ARCHS)) == len(LIGER_ROW_ARCHS)
    assert set(LIGER_CI_ARCHS) == {"gfx942"} and set(LIGER_CI_ARCHS) <= set(LIGER_GEMM_ARCHS)


def test_native_kernels_run_on_any_architecture_and_need_nothing():
    for spec in NATIVE:
        assert spec.archs == () and spec.requires == ()


def test_no_cuda_capability_constraint():
    # ROCm devices report no compute capability; a capability range would reject every one of them.
    assert all(s.capability is None for s in SPECS)


def _best(kind, *, compile_mode):
    eligible = [s for s in SPECS if s.kind == kind and (not compile_mode or s.supports & Supports.TORCH_COMPILE)]
    return max(eligible, key=lambda s: s.priority).id if eligible else None


@pytest.mark.parametrize("kind,eager,compiled", [
    ("rms_norm", "rocm.rms_norm.torch", "rocm.rms_norm.torch"),
    ("layer_norm", "rocm.layer_norm.torch", "rocm.layer_norm.torch"),
    ("silu_gated_mlp", "rocm.silu_gated_mlp.triton", "rocm.silu_gated_mlp.triton"),
    ("gelu_gated_mlp", "rocm.gelu_gated_mlp.triton", "rocm.gelu_gated_mlp.triton"),
    ("rotary_embedding", "rocm.rotary_embedding.triton", "rocm.rotary_embedding.triton"),
    ("residual_rms_norm", "rocm.residual_rms_norm.triton", "rocm.residual_rms_norm.triton"),
    ("causal_lm_loss", "rocm.causal_lm_loss.liger", "rocm.causal_lm_loss.liger"),
    ("moe_experts", "rocm.moe_experts.liger", None),
])
def test_preferred_kernel_per_mode(kind, eager, compiled):
    assert _best(kind, compile_mode=False) == eager
    assert _best(kind, compile_mode=True) == compiled


def test_no_priority_ties_within_a_kind():
    # Ties would fall back to kernel-id order; every choice here is meant to be explicit.
    for kind in {s.kind for s in SPECS}:
        priorities = [s.priority for s in SPECS if s.kind == kind]
        assert len(priorities) == len(set(priorities)), kind


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_impl_resolves(spec):
    module, attr = spec.impl.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
