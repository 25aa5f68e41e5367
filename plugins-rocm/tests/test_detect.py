"""Detection on simulated torch builds: ROCm builds only, one gfx architecture per device, never raising."""

from __future__ import annotations

import sys

import pytest
from kernels_rocm._detect import detect_rocm
from kernels_rocm._detect import gfx_arch
from rocm_testing import H100
from rocm_testing import MI250X
from rocm_testing import MI300X
from rocm_testing import RX7900


@pytest.mark.parametrize("raw,arch", [
    ("gfx942:sramecc+:xnack-", "gfx942"),
    ("gfx90a:sramecc-:xnack+", "gfx90a"),
    ("gfx950:sramecc+:xnack-", "gfx950"),
    ("gfx1100", "gfx1100"),
    ("GFX1201", "gfx1201"),
    (" gfx1030 ", "gfx1030"),
    ("", None),
    ("sm_90", None),
    ("gfx", None),
    (None, None),
    (942, None),
])
def test_gfx_arch_strips_feature_flags_and_rejects_non_gfx_names(raw, arch):
    assert gfx_arch(raw) == arch


def test_rocm_build_reports_each_device_with_its_gfx_arch(simulate):
    simulate("rocm", [MI300X, MI250X, RX7900])
    (info,) = detect_rocm()
    assert (info.backend, info.device_type, info.priority) == ("rocm", "cuda", 100)
    assert info.runtime == "ROCm (HIP 6.4.43482-0f2d60242)"
    assert [(d.index, d.name, d.arch, d.capability) for d in info.devices] == [
        (0, "AMD Instinct MI300X", "gfx942", None),
        (1, "AMD Instinct MI250X", "gfx90a", None),
        (2, "Radeon RX 7900 XTX", "gfx1100", None),
    ]


def test_cuda_build_is_not_claimed_even_though_its_device_type_is_cuda(simulate, caplog):
    simulate("cuda", [H100])
    with caplog.at_level("DEBUG", logger="kernels_rocm._detect"):
        assert detect_rocm() == []
    assert "CUDA build" in caplog.text and "kernels-cuda" in caplog.text


def test_cpu_build_reports_nothing(simulate, caplog):
    simulate("cpu", [])
    with caplog.at_level("DEBUG", logger="kernels_rocm._detect"):
        assert detect_rocm() == []
    assert "not a ROCm build" in caplog.text


def test_rocm_build_without_gpu_reports_backend_with_no_devices(simulate, caplog):
    simulate("rocm", [MI300X], available=False)
    with caplog.at_level("DEBUG", logger="kernels_rocm._detect"):
        (info,) = detect_rocm()
    assert info.backend == "rocm" and info.devices == ()
    assert "sees no GPU" in caplog.text


def test_broken_driver_never_raises(simulate, caplog):
    simulate("rocm", [MI300X], broken=True)
    with caplog.at_level("DEBUG", logger="kernels_rocm._detect"):
        (info,) = detect_rocm()
    assert info.devices == ()
    assert "no ROCm-capable device" in caplog.text


def test_device_without_usable_arch_is_reported_with_arch_none(simulate, caplog):
    simulate("rocm", [("AMD Radeon Graphics", "")])
    with caplog.at_level("DEBUG", logger="kernels_rocm._detect"):
        (info,) = detect_rocm()
    assert [(d.name, d.arch) for d in info.devices] == [("AMD Radeon Graphics", None)]
    assert "no usable gcnArchName" in caplog.text


def test_missing_torch_never_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert detect_rocm() == []
