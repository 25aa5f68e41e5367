"""kernels_npu._detect: detection never raises and says why there is no NPU (simulated NPU host, no hardware)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

import pytest
from kernels_npu import _plugin
from kernels_npu import _torch_npu
from kernels_npu._detect import detect_npu


def test_emulated_npus_are_reported_with_soc_name_and_count(emulation):
    emulation.npu.set_emulated_devices(["Ascend910B2", "Ascend910B2"])
    info = detect_npu()
    assert (info.backend, info.device_type, info.priority) == ("npu", "npu", 100)
    assert info.count == 2
    assert [(d.index, d.name, d.arch) for d in info.devices] == [(0, "Ascend910B2", "Ascend910B2"),
                                                                 (1, "Ascend910B2", "Ascend910B2")]
    assert info.runtime == emulation.__version__


def test_hook_returns_one_backend():
    (info,) = _plugin.kernels_core_detect_devices()
    assert info.backend == "npu" and info.count == 1


def _assert_no_npu(caplog, reason_fragment):
    with caplog.at_level(logging.DEBUG, logger="kernels_npu"):
        info = detect_npu()
    assert info.backend == "npu" and info.devices == ()
    messages = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert reason_fragment in messages, messages


def test_no_device_means_no_npu(emulation, caplog):
    emulation.npu.set_emulated_devices([])
    _assert_no_npu(caplog, "is_available() is False")


def test_torch_npu_not_installed_means_no_npu(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # what Python does for a module that is not there
    _assert_no_npu(caplog, "ModuleNotFoundError")


class _BrokenTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a ``torch_npu`` whose module body raises, as the real one does without CANN or on CUDA torch."""

    def __init__(self, exc):
        self.exc = exc

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.exc


def _failing_import(monkeypatch, exc):
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpu(exc), *sys.meta_path])


@pytest.mark.parametrize(
    ("exc", "fragment"),
    [
        (ImportError("libhccl.so: cannot open shared object file: No such file or directory. Please check that "
                     "the cann package is installed."), "libhccl.so"),
        (ImportError("libtorch_npu.so: undefined symbol: _ZN3c10"), "undefined symbol"),
        (RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda"),
         "Two accelerators"),
        (OSError("libascendcl.so: cannot open shared object file"), "libascendcl.so"),
    ],
    ids=["missing_cann", "version_mismatch", "two_accelerators", "oserror"],
)
def test_torch_npu_import_failure_means_no_npu(monkeypatch, caplog, exc, fragment):
    _failing_import(monkeypatch, exc)
    _assert_no_npu(caplog, fragment)
    with pytest.raises(_torch_npu.TorchNpuUnavailable, match=fragment):
        _torch_npu.load_torch_npu()


def test_driver_error_while_probing_means_no_npu(emulation, monkeypatch, caplog):
    def broken():
        raise RuntimeError("drvGetDevNum failed")

    monkeypatch.setattr(emulation.npu, "device_count", broken)
    _assert_no_npu(caplog, "drvGetDevNum failed")


def test_import_outcome_is_remembered_until_cleared(monkeypatch):
    assert _torch_npu.unavailable_reason() is None
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert _torch_npu.unavailable_reason() is None  # remembered: no second import attempt
    _torch_npu.clear_cache()
    assert "ModuleNotFoundError" in _torch_npu.unavailable_reason()
