"""``tracing`` and ``inference_trace``: the decisions adapters take while Dynamo traces them, on any machine."""

from __future__ import annotations

import torch
from kernels_triton._compile import inference_trace
from kernels_triton._compile import tracing


def _marked(x: torch.Tensor) -> torch.Tensor:
    # 1 where the adapters would hand Inductor the native math, 2 where they keep the custom op, 0 eagerly.
    if inference_trace(x):
        return x * 0 + 1
    return x * 0 + (2 if tracing() else 0)


def test_eager_calls_are_never_traces():
    assert not tracing() and not inference_trace(torch.zeros(2, requires_grad=True))
    assert torch.equal(_marked(torch.zeros(2)), torch.zeros(2))


def test_traced_inference_takes_native_math_and_training_keeps_custom_ops():
    torch._dynamo.reset()
    compiled = torch.compile(_marked, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(torch.zeros(3, requires_grad=True)), torch.ones(3))
    assert torch.equal(compiled(torch.zeros(3)), torch.ones(3)), "no input needs a gradient: nothing to save"
    trained = compiled(torch.zeros(3, requires_grad=True))
    assert torch.equal(trained.detach(), torch.full((3,), 2.0))
