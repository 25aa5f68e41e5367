"""``kernels_triton._device.on_device_of``: which device context the adapters enter around their launches.

The launches themselves on a non-current GPU are checked in ``test_liger_gpu.py`` on machines with two GPUs;
here stand-in tensors and a patched device count check the decision on any machine, CPU CI included.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from kernels_triton import _device
from kernels_triton._device import eager_device_context
from kernels_triton._device import on_device_of


def _on(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device))  # only .device is read


@pytest.fixture
def gpus(monkeypatch):
    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        _device._several_gpus.cache_clear()  # the device count is read once per process

    yield set_count
    _device._several_gpus.cache_clear()


def test_with_several_gpus_the_inputs_device_becomes_current(gpus):
    gpus(2)
    context = on_device_of(_on("cuda:1"))
    assert isinstance(context, torch.cuda.device) and context.idx == 1


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_nothing_to_switch_on_cpu_or_with_one_gpu(gpus, device):
    gpus(1)
    assert isinstance(on_device_of(_on(device)), contextlib.nullcontext)


def test_while_dynamo_traces_the_custom_ops_switch_at_run_time_instead(gpus, monkeypatch):
    # Entering a device context (or even asking for the device count) while tracing broke the graph at every
    # kernel call; the custom ops enter the context themselves when the compiled graph runs.
    gpus(2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert isinstance(on_device_of(_on("cuda:1")), contextlib.nullcontext)


@pytest.mark.parametrize(("count", "switches"), [(1, False), (2, True)])
def test_the_eager_context_skips_only_the_tracing_check(gpus, count, switches):
    gpus(count)
    context = eager_device_context(_on("cuda:1"))
    assert isinstance(context, torch.cuda.device if switches else contextlib.nullcontext)
