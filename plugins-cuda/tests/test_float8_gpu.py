"""The FP8 linear kernels on an FP8-capable NVIDIA GPU (compute capability 8.9 or newer) with torchao.

Bounds, as max |a - b| / max |b| against the bf16 layer (see ``test_float8.py`` and the core's ``_kinds/_dense.py``
for the derivation): 2^-4 + 2^-4 for products of two e4m3 operands (every output, the rowwise recipe's gradients),
2^-3 + 2^-4 where the tensorwise recipe rounds the output gradient to e5m2. The forward product accumulates with
cuBLAS' fast accumulation (torchao's default for the output GEMM), whose extra rounding is far below these bounds.

    PYTHONPATH=... python -m pytest -q plugins-cuda/tests/test_float8_gpu.py
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from float8_checks import BOUND
from float8_checks import BOUND_GRAD
from float8_checks import check_against_bf16
from float8_checks import rel
from float8_checks import request
from kernels_core import Mode
from kernels_core.testing import assert_conforms
from kernels_core.testing import fresh_plugin_manager
from kernels_cuda import _plugin


def _fp8_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        return f"needs FP8 tensor cores (compute capability 8.9 or newer); this GPU has {capability}"
    return None


pytestmark = pytest.mark.skipif(_fp8_gpu() is not None, reason=_fp8_gpu() or "")
torchao = pytest.importorskip("torchao", reason="the FP8 kernels call torchao (kernels-cuda[fp8])")
from kernels_cuda import _float8  # noqa: E402


COMPILED = Mode.TRAINING | Mode.TORCH_COMPILE
RECIPES = ("rowwise", "tensorwise")
# hidden 96 (6 heads of 16), KV 2 x 16 = 32, MLP 160: every projection a multiple of 16, none a power of two.
SIZES = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, vocab_size=257)
PROJECTIONS = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def _pm():
    return fresh_plugin_manager((_plugin, "cuda"))


def _bindings(model):
    """What kernelize sets on each module (torch.compile adds its own flag, ``_is_torch_compile``)."""
    keys = ("forward", "_kernels_core_binding", "_kernels_core_report")
    return {name: {k: module.__dict__.get(k) for k in keys} for name, module in model.named_modules()}


def _model(seed=0):
    from kernels_core.testing import tiny_causal_lm

    return tiny_causal_lm("llama", dtype=torch.bfloat16, seed=seed, **SIZES).cuda()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("rows", "k", "n", "bias"), [
    (14, 48, 80, False),  # rows not a multiple of 16: the padded weight-gradient product
    (3 * 37, 208, 336, True),
    (2 * 1024, 1040, 2064, False),
    (4096, 4096, 1024, False),  # a Llama-3.1-8B k_proj / v_proj on 2 x 2048 tokens
])
def test_forward_and_backward_against_bf16(recipe, rows, k, n, bias):
    (x, w, b), out, _, _ = check_against_bf16(lambda x, w, b: _float8.float8_linear(x, w, b, recipe=recipe), recipe,
                                              rows, k, n, bias, device="cuda")
    # The hardware products agree with torchao's float32 emulation of the same roundings.
    emulated = _float8.float8_linear(x, w, b, recipe=recipe, emulate=True)
    assert rel(out, emulated) <= 2.0**-6


@pytest.mark.parametrize("recipe", RECIPES)
def test_conformance(recipe):
    """``kernels-core check`` for the kernel: the linear kind's cases, eager and under torch.compile."""
    report = assert_conforms("cuda", kernel=f"cuda.linear.float8_{recipe}", plugin_manager=_pm())
    assert any(r.status == "pass" and r.case and "compiled" in r.case for r in report.results)


@pytest.mark.parametrize("recipe", RECIPES)
def test_kernelize_report_compile_and_unkernelize(recipe):
    model, reference = _model(), _model()
    before = _bindings(model)
    kernels_core.kernelize(model, mode=COMPILED, config=request(recipe), plugin_manager=_pm())
    rows = {e.module: e for e in kernels_core.get_report(model).entries if e.kind == "linear"}
    bound = {name for name, e in rows.items() if e.kernel == f"cuda.linear.float8_{recipe}"}
    assert bound == {f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert rows["lm_head"].kernel is None
    ids = torch.randint(3, 257, (2, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    # One decoder layer's MLP (three FP8 projections) traces into one graph and computes what it does eagerly, up
    # to FP8 roundings: Inductor keeps silu(gate) * up in float32, so a few of down_proj's inputs round to the
    # neighbouring FP8 value.
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 64, 96, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled_mlp = torch.compile(mlp, fullgraph=True)
    assert rel(compiled_mlp(x), mlp(x)) <= BOUND
    assert rel(compiled_mlp(x), reference.model.layers[0].mlp(x)) <= 2 * BOUND
    # The whole model compiled: forward and backward against the bf16 model; two decoder layers of FP8 products.
    compiled = torch.compile(model)
    out = compiled.model(input_ids=ids).last_hidden_state
    expected = reference.model(input_ids=ids).last_hidden_state
    assert rel(out, expected) <= BOUND
    grad = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1)).to(out)
    out.backward(grad)
    expected.backward(grad)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        if "proj" in name:
            assert rel(param.grad, ref_param.grad) <= 2 * BOUND_GRAD[recipe], name
    torch._dynamo.reset()
    kernels_core.unkernelize(model)
    assert _bindings(model) == before


def test_eager_mode_is_refused_with_the_reason():
    model = _model()
    with pytest.raises(kernels_core.KernelizeError, match="runs only under torch.compile"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, config=request("rowwise"), plugin_manager=_pm())


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_steps_stay_finite_and_close_to_bf16(recipe):
    """30 AdamW steps of the compiled model memorising one batch: the loss falls below half its start in both, and
    FP8's final loss is within 2% of bf16's fall from its start (on the CPU, with torch's float8 products: 0.1%).
    ``benchmarks/cuda/fp8_accuracy.py`` measures the difference on a learnable task at scale."""
    losses = {}
    for fp8 in (False, True):
        model = _model(seed=1)
        if fp8:
            kernels_core.kernelize(model, mode=COMPILED, config=request(recipe), plugin_manager=_pm())
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(3, 257, (4, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
        run = []
        for _ in range(30):
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(float(loss))
        losses[fp8] = run
        torch._dynamo.reset()
    for run in losses.values():
        assert all(torch.isfinite(torch.tensor(run))) and run[-1] < 0.5 * run[0]
    fall = losses[False][0] - losses[False][-1]
    assert abs(losses[True][-1] - losses[False][-1]) <= 0.02 * fall
