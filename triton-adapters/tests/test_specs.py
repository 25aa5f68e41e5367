"""CPU tests of the shared declarations: the ROCm plugin reuses these with its own values."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from kernels_core.plugin import CapabilityRange
from kernels_core.plugin import Supports
from kernels_triton import LIGER_ADAPTERS
from kernels_triton import NATIVE_ADAPTERS
from kernels_triton import liger_kernel_specs
from kernels_triton import native_kernel_specs


def test_liger_specs_per_backend_carry_backend_constraints_and_priorities():
    specs = liger_kernel_specs("rocm", priority=90, priorities={"rms_norm": 70}, archs=("gfx942",))
    assert {s.backend for s in specs} == {"rocm"}
    assert all(s.id == f"rocm.{s.kind}.liger" for s in specs)
    assert {s.kind: s.priority for s in specs}["rms_norm"] == 70
    assert {s.priority for s in specs if s.kind != "rms_norm"} == {90}
    assert all(s.archs == ("gfx942",) and s.requires == ("liger-kernel>=0.8.5",) for s in specs)


def test_exclude_and_capability():
    specs = liger_kernel_specs("cuda", exclude=("moe_experts",), capability=CapabilityRange(min=(8, 0)))
    assert "moe_experts" not in {s.kind for s in specs}
    assert all(s.capability == CapabilityRange(min=(8, 0)) for s in specs)


def test_unknown_kind_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match="rms_norm"):
        liger_kernel_specs("cuda", priorities={"rmsnorm": 1})


def test_only_compile_safe_liger_kernel_declares_torch_compile():
    compiled = {k for k, e in LIGER_ADAPTERS.items() if e.supports & Supports.TORCH_COMPILE}
    assert compiled == {"causal_lm_loss"}
    # packed_attention reads document offsets off the mask on the host, which a compiled graph cannot: its adapter
    # falls back to sdpa while compiling, and is declared without TORCH_COMPILE.
    assert {k for k, e in NATIVE_ADAPTERS.items() if not e.supports & Supports.TORCH_COMPILE} == {"packed_attention"}
    # Every declaration builds (KernelSpec refuses native_when_compiled without TORCH_COMPILE).
    assert {s.kind for s in native_kernel_specs("cuda")} == {e.kind for e in NATIVE_ADAPTERS.values()}


@pytest.mark.parametrize("entry", [*LIGER_ADAPTERS.values(), *NATIVE_ADAPTERS.values()], ids=lambda e: e.impl)
def test_every_impl_reference_resolves(entry):
    module, attr = entry.impl.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_native_ids():
    assert [s.id for s in native_kernel_specs("cuda")][:1] == ["cuda.rms_norm.torch"]


def test_package_import_is_cheap():
    code = ("import sys, kernels_triton; "
            "print(sorted(m for m in ('torch', 'triton', 'liger_kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
