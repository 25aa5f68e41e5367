"""kernels_npu._rms_norm against eager transformers RMSNorm modules (NPU verified against the emulation only)."""

from __future__ import annotations

import pytest
import torch
from kernels_npu._rms_norm import rms_norm
from npu_testing import assert_close
from npu_testing import assert_grad_close
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN = 67  # odd on purpose


def _check(module, x, *, offset, casting, dtype):
    x_ref = x.detach().clone().requires_grad_()
    x_npu = x.detach().clone().requires_grad_()
    expected = module(x_ref)
    weight = module.weight
    actual = rms_norm(x_npu, weight, eps=module_eps(module), offset=offset, casting=casting)
    assert_close(actual, expected, dtype, what="output")
    grad = torch.randn_like(expected)
    (ref_dx, ref_dw) = torch.autograd.grad(expected, (x_ref, weight), grad)
    (dx, dw) = torch.autograd.grad(actual, (x_npu, weight), grad)
    assert_grad_close(dx, ref_dx, dtype, what="grad x")
    # The weight gradient sums over every row, so its low-precision error grows with the row count.
    assert_grad_close(dw.float(), ref_dw.float(), dtype if dtype == torch.float32 else torch.bfloat16,
                      what="grad weight")


def module_eps(module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_rms_norm_matches_llama_rmsnorm(dtype):
    module = LlamaRMSNorm(HIDDEN, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.3)
    x = torch.randn(3, 5, HIDDEN, dtype=dtype)
    _check(module, x, offset=0.0, casting="llama", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_npu_rms_norm_matches_gemma_offset_rmsnorm(dtype):
    module = GemmaRMSNorm(HIDDEN, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.3)
    x = torch.randn(2, 7, HIDDEN, dtype=dtype)
    _check(module, x, offset=1.0, casting="gemma", dtype=dtype)


def test_emulated_offset_variant_passes_one_plus_weight_not_the_raw_zero_weight(emulation):
    # LLaMA-Factory's Qwen3.5 bug: gamma = raw zero-initialised weight gave all-zero outputs.
    module = GemmaRMSNorm(HIDDEN)  # weight is all zeros at init
    x = torch.randn(4, HIDDEN)
    out = rms_norm(x, module.weight, eps=module.eps, offset=1.0, casting="gemma")
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, module(x))
    (name, args), = emulation.calls
    assert name == "npu_rms_norm"
    assert torch.equal(args["gamma"], torch.ones(HIDDEN))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_gamma_is_cast_to_the_input_dtype(emulation, dtype):
    # npu_rms_norm rejects a gamma whose dtype differs from the input; fp32 master weights with low-precision
    # activations must still work, and return the promoted dtype like eager Llama does.
    module = LlamaRMSNorm(HIDDEN)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.3)
    x = torch.randn(6, HIDDEN, dtype=dtype)
    out = rms_norm(x, module.weight, eps=module.variance_epsilon, offset=0.0, casting="llama")
    expected = module(x)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
    assert emulation.calls[-1][1]["gamma"].dtype == dtype


def test_emulated_npu_rms_norm_rejects_mismatched_gamma_dtype(emulation):
    with pytest.raises(RuntimeError, match="gamma dtype"):
        emulation.npu_rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8))


def test_unknown_casting_raises():
    with pytest.raises(ValueError, match="casting"):
        rms_norm(torch.randn(2, 8), torch.ones(8), eps=1e-6, offset=0.0, casting="t5")
