"""The portable residual add + RMSNorm against the eager decoder-layer ops it replaces, forward and backward.

Eagerly a pre-norm decoder layer computes ``new = residual + x`` and ``post_attention_layernorm(new)``; the new
residual also feeds the layer's final add. The portable kernel runs the very same ops (the norm recomputed in
backward), so on CPU results are compared for bit equality, with upstream gradients on both outputs.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_core._portable._residual_rms_norm import residual_rms_norm
from kernels_core.testing import reference


def _module(path: str, name: str) -> type[torch.nn.Module]:
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{path}.{name} is not in this transformers version")


CASES = [
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", 0.0, "llama"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", 1.0, "gemma"),
]
IDS = [case[1] for case in CASES]


def _eager(module: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return module(new_residual), new_residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("path", "name", "offset", "casting"), CASES, ids=IDS)
def test_matches_the_eager_layer_ops_bitwise(path, name, offset, casting, dtype):
    generator = torch.Generator().manual_seed(0)
    module = _module(path, name)(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(48, generator=generator) * 0.5)
    x = (torch.randn(3, 11, 48, generator=generator) * 3).to(dtype).requires_grad_()
    residual = (torch.randn(3, 11, 48, generator=generator) * 2).to(dtype).requires_grad_()
    inputs = (x, residual, module.weight)

    expected = _eager(module, x, residual)
    upstream = [torch.randn(t.shape, generator=generator).to(t.dtype) for t in expected]
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    eps = getattr(module, "variance_epsilon", None) or module.eps
    actual = residual_rms_norm(x, residual, module.weight, eps=eps, offset=offset, casting=casting)
    actual_grads = torch.autograd.grad(actual, inputs, upstream)

    for a, e, what in zip(actual, expected, ("normed", "new residual"), strict=True):
        assert a.dtype == e.dtype, what
        assert torch.equal(a, e), what
    for a, e, what in zip(actual_grads, expected_grads, ("x", "residual", "weight"), strict=True):
        assert torch.equal(a, e), f"grad of {what}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_math(dtype):
    generator = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(2, 7, 40, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(40, generator=generator).to(dtype)
    for offset, casting in ((0.0, "llama"), (1.0, "gemma"), (1.0, "llama")):
        with torch.no_grad():
            actual = residual_rms_norm(x, residual, weight, eps=1e-6, offset=offset, casting=casting)
            expected = reference.residual_rms_norm(x, residual, weight, eps=1e-6, offset=offset, casting=casting)
        assert torch.equal(actual[1], expected[1])
        assert torch.equal(actual[0], expected[0]), f"{offset}/{casting}"


def test_inference_path_builds_no_graph():
    x, residual, weight = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    with torch.no_grad():
        normed, new_residual = residual_rms_norm(x, residual, weight, eps=1e-6)
    assert normed.grad_fn is None and new_residual.grad_fn is None
