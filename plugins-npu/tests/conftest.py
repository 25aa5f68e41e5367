"""Test setup: the reference emulation of torch_npu (``tests/emulation``) is installed as ``torch_npu``.

NPU behaviour in this suite is verified against that emulation only, not on Ascend hardware. Importing the
emulation also installs a simulated ``torch.npu`` device module (one emulated "Ascend910B2" by default), which
is what detection reads; tests that need a host without torch_npu or without devices say so explicitly.
As on a real Ascend host, transformers then also sees torch_npu (``is_torch_npu_available()``); the models
still live on CPU, and the eager references run transformers' own CPU code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


EMULATION = Path(__file__).parent / "emulation"
sys.path.insert(0, str(EMULATION))

import torch_npu  # noqa: E402  (the emulation, from the path inserted above)
from kernels_npu import _torch_npu  # noqa: E402


assert getattr(torch_npu, "EMULATED", False), f"expected the test emulation, imported {torch_npu.__file__}"


@pytest.fixture(autouse=True)
def _emulated_npu_host() -> object:
    """Every test starts on a simulated one-NPU host, with a fresh torch_npu import outcome and call log."""
    _torch_npu.clear_cache()
    torch_npu.npu.set_emulated_devices(["Ascend910B2"])
    torch_npu.calls.clear()
    torch.manual_seed(0)
    yield
    _torch_npu.clear_cache()
    torch_npu.npu.set_emulated_devices(["Ascend910B2"])


@pytest.fixture
def emulation() -> object:
    """The emulated torch_npu module (for its call log and device list)."""
    return torch_npu
