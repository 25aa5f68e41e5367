"""Detection with simulated torch builds: CUDA claims NVIDIA devices only, never a ROCm build's."""

from __future__ import annotations

import sys
import types

import pytest
from kernels_cuda._detect import detect_cuda


def _fake_torch(*, cuda: str | None, hip: str | None, devices: list[tuple[str, tuple[int, int]]],
                broken: bool = False) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.__version__ = "2.13.0+fake"
    torch.version = types.SimpleNamespace(cuda=cuda, hip=hip)

    def device_count():
        if broken:
            raise RuntimeError("driver exploded")
        return len(devices)

    torch.cuda = types.SimpleNamespace(
        device_count=device_count,
        get_device_name=lambda i: devices[i][0],
        get_device_capability=lambda i: devices[i][1],
    )
    return torch


@pytest.fixture
def simulate(monkeypatch):
    def install(**kwargs):
        monkeypatch.setitem(sys.modules, "torch", _fake_torch(**kwargs))

    return install


def test_cuda_build_reports_each_device_with_capability(simulate):
    simulate(cuda="13.0", hip=None, devices=[("NVIDIA H200", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))])
    (info,) = detect_cuda()
    assert (info.backend, info.device_type, info.priority, info.runtime) == ("cuda", "cuda", 100, "CUDA 13.0")
    assert [(d.index, d.name, d.capability) for d in info.devices] == [
        (0, "NVIDIA H200", (9, 0)), (1, "NVIDIA A100-SXM4-80GB", (8, 0))]


def test_rocm_build_is_not_claimed_even_though_its_device_type_is_cuda(simulate, caplog):
    simulate(cuda=None, hip="6.4.43482", devices=[("AMD Instinct MI300X", (9, 4))])
    with caplog.at_level("DEBUG", logger="kernels_cuda._detect"):
        assert detect_cuda() == []
    assert "ROCm build" in caplog.text


def test_cpu_build_reports_nothing(simulate):
    simulate(cuda=None, hip=None, devices=[])
    assert detect_cuda() == []


def test_cuda_build_without_gpu_reports_backend_with_no_devices(simulate):
    simulate(cuda="12.8", hip=None, devices=[])
    (info,) = detect_cuda()
    assert info.devices == ()


def test_broken_driver_never_raises(simulate, caplog):
    simulate(cuda="12.8", hip=None, devices=[("x", (9, 0))], broken=True)
    with caplog.at_level("DEBUG", logger="kernels_cuda._detect"):
        (info,) = detect_cuda()
    assert info.devices == () and "driver exploded" in caplog.text


def test_missing_torch_never_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert detect_cuda() == []
