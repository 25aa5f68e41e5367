"""The per-call choice of ``kernels_cuda._ops.rms_norm`` (the ``cuda.rms_norm.tuned`` kernel).

The two implementations it chooses between are tested numerically in kernels-triton; here spies stand in for
them so that the policy itself (measured thresholds, native math while Dynamo traces) is checked on CPU, with
``meta`` tensors for sizes that would not fit a test's memory.
"""

from __future__ import annotations

import pytest
import torch
from kernels_cuda import _ops


@pytest.fixture
def chosen(monkeypatch):
    calls: list[str] = []

    def spy(name):
        def record(hidden_states, weight, **kwargs):
            calls.append(name)
            return hidden_states

        return record

    monkeypatch.setattr(_ops._triton, "rms_norm", spy("triton"))
    monkeypatch.setattr(_ops._native, "rms_norm", spy("native"))
    return calls


def _call(rows: int, cols: int, *, grad: bool) -> None:
    x = torch.empty(rows, cols, device="meta", requires_grad=grad)
    _ops.rms_norm(x, torch.empty(cols, device="meta"), eps=1e-6, offset=0.0, casting="llama")


@pytest.mark.parametrize(("rows", "cols", "grad", "expected"), [
    (8192, 1024, False, "native"),  # 2**23 elements: below the no-grad threshold
    (16384, 1024, False, "triton"),  # 2**24
    (16384, 1024, True, "native"),  # with autograd the threshold is 2**28 and rows of 4096 or more
    (65536, 4096, True, "triton"),  # 2**28, hidden 4096
    (262144, 1024, True, "native"),  # 2**28 but rows of 1024
])
def test_thresholds_pick_the_measured_winner(chosen, rows, cols, grad, expected):
    _call(rows, cols, grad=grad)
    assert chosen == [expected]


@pytest.mark.parametrize("grad", [False, True])
def test_traced_calls_take_the_native_math_at_every_size(chosen, monkeypatch, grad):
    # Under torch.compile Inductor fuses the native math with its neighbours (measured faster than the Triton
    # kernel as a custom op), so the size thresholds do not apply there.
    monkeypatch.setattr(_ops, "tracing", lambda: True)
    _call(65536, 4096, grad=grad)
    assert chosen == ["native"]
