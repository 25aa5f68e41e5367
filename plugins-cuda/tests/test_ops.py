"""The per-call choice of ``kernels_cuda._ops`` (the ``cuda.rms_norm.tuned`` and ``cuda.residual_rms_norm.tuned``
kernels).

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
        def record(hidden_states, *tensors, **kwargs):
            calls.append(name)
            return hidden_states

        return record

    # The kernels_triton.ops names _ops calls: the native pair, the Triton residual adapter (while traced) and the
    # eager entry points kernels-cuda calls when it knows it is not traced.
    monkeypatch.setattr(_ops, "native_rms_norm", spy("native"))
    monkeypatch.setattr(_ops, "native_residual_rms_norm", spy("native"))
    monkeypatch.setattr(_ops, "triton_residual_rms_norm", spy("triton"))
    monkeypatch.setattr(_ops, "eager_rms_norm", spy("triton"))
    monkeypatch.setattr(_ops, "eager_residual_rms_norm", spy("triton"))
    return calls


def _call(rows: int, cols: int, *, grad: bool, residual: bool = False) -> None:
    x = torch.empty(rows, cols, device="meta", requires_grad=grad)
    w = torch.empty(cols, device="meta")
    if residual:
        _ops.residual_rms_norm(x, torch.empty(rows, cols, device="meta"), w, eps=1e-6, offset=0.0, casting="llama")
    else:
        _ops.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "residual_rms_norm"])
@pytest.mark.parametrize(("rows", "cols", "grad", "expected"), [
    (2048, 1024, False, "native"),  # 2**21 elements: below the no-grad threshold
    (4096, 1024, False, "triton"),  # 2**22
    (32768, 128, False, "triton"),  # narrow rows count by elements too
    (4096, 1024, True, "native"),  # 2**22 with autograd: below its threshold
    (8192, 1024, True, "triton"),  # 2**23 with autograd (Qwen3-0.6B's training norms)
    (65536, 128, True, "triton"),  # narrow rows (per-head q/k norms) by elements too
    (16384, 4096, True, "triton"),
])
def test_thresholds_pick_the_measured_winner(chosen, rows, cols, grad, expected, residual):
    _call(rows, cols, grad=grad, residual=residual)
    assert chosen == [expected]


def test_residual_gradient_counts_when_only_the_residual_needs_it(chosen):
    # The residual stream carries gradient even where the attention output does not: autograd is on.
    # 2**22 elements: the no-grad threshold would pick Triton, the with-grad one picks the native pair.
    x = torch.empty(4096, 1024, device="meta")
    _ops.residual_rms_norm(x, torch.empty(4096, 1024, device="meta", requires_grad=True),
                           torch.empty(1024, device="meta"), eps=1e-6, offset=0.0, casting="llama")
    assert chosen == ["native"]


@pytest.mark.parametrize("grad", [False, True])
def test_traced_calls_take_the_native_math_at_every_size(chosen, monkeypatch, grad):
    # Under torch.compile Inductor fuses the native math with its neighbours (measured faster than the Triton
    # kernel as a custom op), so the size thresholds do not apply there.
    monkeypatch.setattr(_ops, "is_compiling", lambda: True)
    _call(65536, 4096, grad=grad)
    assert chosen == ["native"]


@pytest.mark.parametrize("grad", [False, True])
def test_traced_residual_calls_defer_to_the_triton_adapter(chosen, monkeypatch, grad):
    # While Dynamo traces, the Triton adapter itself picks (its custom op in training graphs, native math for
    # inference), at every size.
    monkeypatch.setattr(_ops, "is_compiling", lambda: True)
    _call(8, 64, grad=grad, residual=True)
    assert chosen == ["triton"]


@pytest.mark.parametrize("grad", [False, True])
def test_public_thresholds_move_the_crossover(chosen, grad):
    from kernels_cuda import ops

    name = "min_elements_with_grad" if grad else "min_elements"
    previous = ops.set_rms_norm_thresholds(**{name: 0})
    try:
        _call(8, 64, grad=grad)
        assert ops.rms_norm_thresholds()._asdict()[name] == 0
    finally:
        ops.set_rms_norm_thresholds(**previous._asdict())
    _call(8, 64, grad=grad)
    assert chosen == ["triton", "native"]
    assert ops.rms_norm_thresholds() == previous


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_public_thresholds_refuse_non_counts(value):
    from kernels_cuda import ops

    with pytest.raises(ValueError, match="non-negative int"):
        ops.set_rms_norm_thresholds(min_elements=value)
