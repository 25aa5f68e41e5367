"""Fixtures: simulated torch builds (ROCm, CUDA, CPU-only) on the real CPU torch, and a clean environment.

There is no AMD GPU in CI. A simulated build patches exactly what detection reads: ``torch.version.hip`` and
``torch.version.cuda``, ``torch.cuda.is_available``, ``device_count``, ``get_device_properties``,
``get_device_name`` and ``get_device_capability``. Models stay on the CPU, so the kernels bound by
``kernelize(..., device="cuda")`` run their CPU paths; what these tests check is detection and resolution.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kernels_core.testing import isolate_environment


# Helper modules of this suite (rocm_testing) import by name, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    isolate_environment(monkeypatch, tmp_path)


def _import_device_probing_modules() -> None:
    """Import, on the real torch, the modules that query the device when imported.

    transformers' modeling code imports its quantizers, which import torchao where it is installed; torchao calls
    ``torch.utils._triton.has_triton()`` at import, which asks the CUDA device interface for the current device's
    properties once ``torch.cuda.is_available()`` says True. Under a simulated build that reaches the real CPU-only
    torch ("Torch not compiled with CUDA enabled"), and a value computed then would stay in has_triton's
    process-wide cache. Importing them first gives them the real build, as in a process where they are imported
    before any device is used.
    """
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:
        return


@pytest.fixture
def simulate(monkeypatch) -> Callable[..., None]:
    """Make the real torch look like a ROCm, CUDA or CPU-only build with the given devices.

    ``simulate("rocm", [MI300X, RX7900])``, ``simulate("cuda", [H100])``, ``simulate("cpu", [])``; ``broken=True``
    makes every device query raise like a failing driver.
    """

    def install(build: str, devices: list[tuple[str, object]], *, broken: bool = False,
                available: bool = True) -> None:
        assert build in ("rocm", "cuda", "cpu")
        _import_device_probing_modules()
        monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242" if build == "rocm" else None)
        monkeypatch.setattr(torch.version, "cuda", "12.8" if build == "cuda" else None)

        def query(value: object) -> object:
            if broken:
                raise RuntimeError("HIP error: no ROCm-capable device is detected")
            return value

        monkeypatch.setattr(torch.cuda, "is_available", lambda: build != "cpu" and available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: query(len(devices)))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: query(devices[i][0]))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: query(types.SimpleNamespace(
            name=devices[i][0], gcnArchName=devices[i][1] if build == "rocm" else "")))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: query(
            devices[i][1] if build == "cuda" else (9, 4)))

    return install
