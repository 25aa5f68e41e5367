"""The portable RMSNorm against the transformers modules it replaces, forward and backward.

The kernel runs the very ops of the eager module (torch's ``rms_norm`` decomposes to them on CPU) and
recomputes them in backward, so on CPU results are compared for bit equality, not within a tolerance.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernels_core._portable._rms_norm import rms_norm


def _module(path: str, name: str) -> type[torch.nn.Module]:
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{path}.{name} is not in this transformers version")


# (module path, class, offset, casting): what the core's matcher reports for each.
CASES = [
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", 0.0, "llama"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", 0.0, "llama"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", 1.0, "gemma"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm", 1.0, "gemma"),
]
IDS = [case[1] for case in CASES]


def _eps(module: torch.nn.Module) -> float:
    return getattr(module, "variance_epsilon", None) or module.eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("path", "name", "offset", "casting"), CASES, ids=IDS)
def test_matches_transformers_bitwise(path, name, offset, casting, dtype):
    generator = torch.Generator().manual_seed(0)
    module = _module(path, name)(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(48, generator=generator) * 0.5)
    x = (torch.randn(3, 11, 48, generator=generator) * 3).to(dtype).requires_grad_()

    expected = module(x)
    upstream = torch.randn(expected.shape, generator=generator).to(expected.dtype)
    expected_grads = torch.autograd.grad(expected, (x, module.weight), upstream)
    actual = rms_norm(x, module.weight, eps=_eps(module), offset=offset, casting=casting)
    actual_grads = torch.autograd.grad(actual, (x, module.weight), upstream)

    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)
    assert torch.equal(actual_grads[0], expected_grads[0])
    assert torch.equal(actual_grads[1], expected_grads[1])


@pytest.mark.parametrize(("path", "name", "offset", "casting"), CASES, ids=IDS)
def test_inference_path(path, name, offset, casting):
    module = _module(path, name)(16).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, module.weight, eps=_eps(module), offset=offset, casting=casting), module(x))


def _saved_bytes(fn) -> int:
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(saved.values())


@pytest.mark.parametrize(("dtype", "eager_over_ours"), [(torch.float32, 2), (torch.bfloat16, 3)])
def test_saves_less_for_backward_than_eager(dtype, eager_over_ours):
    """Eager keeps the float32 input copy and the normalised output; the kernel keeps only the input."""
    llama_norm = _module(*CASES[0][:2])
    module = llama_norm(256).to(dtype)
    x = torch.randn(512, 256, dtype=dtype, requires_grad=True)
    eager = _saved_bytes(lambda: module(x))
    ours = _saved_bytes(lambda: rms_norm(x, module.weight, eps=1e-6, casting="llama"))
    # Up to the tiny per-row rstd and the weight, which both save.
    assert ours < eager / eager_over_ours * 1.05


def test_unknown_casting_is_rejected():
    with pytest.raises(ValueError, match="unknown RMSNorm casting 't5'"):
        rms_norm(torch.randn(2, 4), torch.ones(4), eps=1e-6, casting="t5")
