"""The FP8 linear kernels (``cuda.linear.float8_rowwise`` / ``float8_tensorwise``) on the CPU.

torch 2.13's CPU build runs ``torch._scaled_mm`` on float8 operands, and torchao can emulate the products in float32,
so the kernels' numbers, their binding, report rows and ``unkernelize`` are checked here without a GPU; a simulated
Hopper device (a test plugin reporting capability 9.0 for the ``cuda`` backend) lets kernelize choose them for
modules that stay on the CPU. ``test_float8_gpu.py`` repeats the numerical checks on a real Hopper GPU.

Bounds (max |a - b| / max |b| against the bf16 layer), from the rounding of one FP8 cast (half an ulp: 2^-4 of the
value for e4m3, 3 mantissa bits; 2^-3 for e5m2): a product of two rounded operands is off by at most the sum of
their bounds per term, 2^-3 for e4m3 x e4m3 (every output; the rowwise recipe's gradients) and 2^-3 + 2^-4 where
the tensorwise recipe rounds the output gradient to e5m2 (its input and weight gradients). These are the ``linear``
kind's bounds (kernels-core's ``_kinds/_dense.py`` derives them and records the errors measured over 40 seeds).
"""

from __future__ import annotations

import dataclasses
import types

import kernels_core
import pytest
import torch
from float8_checks import BOUND
from float8_checks import BOUND_GRAD
from float8_checks import check_against_bf16
from float8_checks import rel
from float8_checks import request
from kernels_core import KernelizeError
from kernels_core import Mode
from kernels_core.plugin import BackendInfo
from kernels_core.plugin import DeviceInfo
from kernels_core.plugin import hookimpl
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm
from kernels_cuda import _float8_specs
from kernels_cuda import _plugin


COMPILED = Mode.TRAINING | Mode.TORCH_COMPILE
SIZES = {"hidden_size": 48, "intermediate_size": 80, "head_dim": 12}
PROJECTIONS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def float8():
    """The kernels' module (it imports torchao), where this torch multiplies float8 tensors on the CPU."""
    pytest.importorskip("torchao", reason="the FP8 kernels call torchao (kernels-cuda[fp8])")
    from kernels_cuda import _float8

    one = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    scale = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(one, one.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch {torch.__version__} does not multiply float8 tensors on the CPU ({type(exc).__name__})")
    return _float8


def _cpu_rowwise_problem() -> str | None:
    """Why this torch cannot run the rowwise recipe on the CPU, or None: its CPU ``_scaled_mm`` takes per-row and
    per-column scales from torch 2.13 on (2.11 asserts per-tensor scales), where GPUs took them long before."""
    one = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only ({type(exc).__name__})"
    return None


def _recipe_here(recipe: str, emulate: bool = False) -> None:
    """Skip a rowwise case that needs the CPU's own float8 product where this torch has none for row scales."""
    if recipe == "rowwise" and not emulate and (problem := _cpu_rowwise_problem()):
        pytest.skip(problem)


def _simulated_gpu(capability=(9, 0)):
    module = types.ModuleType("simulated_gpu")
    module.kernels_core_detect_devices = hookimpl(
        lambda: [BackendInfo("cuda", "cuda", (DeviceInfo(0, "simulated GPU", capability=capability),), priority=100)])
    return module


def _pm(capability=(9, 0), plugin=_plugin):
    return fresh_plugin_manager((plugin, "cuda"), (_simulated_gpu(capability), "simulated_gpu"))


def _model(seed=0, dtype=torch.bfloat16):
    return tiny_causal_lm("llama", dtype=dtype, seed=seed, **SIZES)


def _state(model):
    return {name: dict(module.__dict__) for name, module in model.named_modules()}


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize(("rows", "k", "n", "bias"), [(14, 48, 80, False), (32, 208, 144, True), (3, 80, 48, False)])
def test_forward_and_backward_within_the_fp8_bound(float8, recipe, emulate, rows, k, n, bias):
    _recipe_here(recipe, emulate)
    # Rows not a multiple of 16 (14, 3) take the padded weight-gradient product.
    _, _, got, want = check_against_bf16(lambda x, w, b: float8.float8_linear(x, w, b, recipe=recipe, emulate=emulate),
                                         recipe, rows, k, n, bias, device="cpu")
    if bias:
        assert rel(got[2], want[2]) <= 2.0**-8  # the bias gradient is a bf16 sum of the output gradient


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_autocast_casts_like_f_linear(float8, recipe):
    _recipe_here(recipe)
    x = torch.randn(2, 16, 32)
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = getattr(float8, f"float8_{recipe}_linear")(x, w)
        ref = torch.nn.functional.linear(x, w)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert rel(out, ref) <= BOUND


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_traces_into_one_graph(float8, recipe):
    _recipe_here(recipe)
    x = torch.randn(2, 7, 48, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(80, 48, dtype=torch.bfloat16, requires_grad=True)
    for fn in (getattr(float8, f"float8_{recipe}_linear"),):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        out = compiled(x, w)
        out.sum().backward()
        assert torch.equal(out, fn(x, w))
    torch._dynamo.reset()


def test_declarations():
    specs = {s.id: s for s in _float8_specs.float8_kernel_specs("cuda")}
    assert set(specs) == {"cuda.linear.float8_rowwise", "cuda.linear.float8_tensorwise"}
    for spec in specs.values():
        assert (spec.kind, spec.dtypes, spec.compile_only) == ("linear", ("bfloat16",), True)
        assert spec.capability.min == (8, 9) and spec.requires == ("torchao>=0.17,<0.19",)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_kernelize_binds_every_projection_reports_and_unkernelize_restores(float8, recipe, monkeypatch):
    _recipe_here(recipe)
    model, reference = _model(), _model()
    before = _state(model)
    kernels_core.kernelize(model, mode=COMPILED, device="cuda", config=request(recipe), plugin_manager=_pm())
    rows = {e.module: e for e in kernels_core.get_report(model).entries if e.kind == "linear"}
    bound = {name for name, e in rows.items() if e.kernel == f"cuda.linear.float8_{recipe}"}
    assert bound == {f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert all(rows[n].note == "preferred by config" and rows[n].plugin == "cuda" for n in bound)
    assert "multiples of 16" in rows["model.layers.0.self_attn.k_proj"].reason
    assert "lm_head = true" in rows["lm_head"].reason
    # Every bound projection runs torchao's float8 product, on its own bf16 weight parameter.
    calls = []
    original = float8.matmul_with_hp_or_float8_args

    class Counting:
        @staticmethod
        def apply(input, weight_t, *args):
            calls.append(weight_t)
            return original.apply(input, weight_t, *args)

    monkeypatch.setattr(float8, "matmul_with_hp_or_float8_args", Counting)
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model.model(input_ids=ids).last_hidden_state
    expected = reference.model(input_ids=ids).last_hidden_state
    assert len(calls) == len(bound)
    weights = {id(model.get_submodule(n).weight) for n in bound}
    assert {id(w._base) for w in calls} == weights  # weight.t() views of the modules' own parameters
    assert all(type(model.get_submodule(n).weight) is torch.nn.Parameter for n in bound)
    # Two decoder layers of FP8 products: the output within one product's bound (the residual stream carries
    # it), every projection weight's gradient within two (its own product and the next layer's, in the chain).
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad)
    expected.backward(grad)
    assert rel(out, expected) <= BOUND
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        if "proj" in name:
            assert rel(param.grad, ref_param.grad) <= 2 * BOUND_GRAD[recipe], name
    kernels_core.unkernelize(model)
    assert _state(model) == before


def _refused(model, pm, *, mode=COMPILED, recipe="tensorwise", device="cuda"):
    before = _state(model)
    with pytest.raises(KernelizeError) as raised:
        kernels_core.kernelize(model, mode=mode, device=device, config=request(recipe), plugin_manager=pm)
    assert _state(model) == before
    return str(raised.value)


def test_requests_this_machine_cannot_honour_raise():
    assert "capability out of range: device is 8.0, kernel needs 8.9" in _refused(_model(), _pm((8, 0)))
    assert "runs only under torch.compile" in _refused(_model(), _pm(), mode=Mode.TRAINING)
    assert "dtype unsupported: handles ['bfloat16'], module is float32" in _refused(
        _model(dtype=torch.float32), _pm())
    # No device at all: the CPU modules of a CPU-only machine.
    assert "runs on backend cuda, module is on cpu" in _refused(
        _model(), fresh_plugin_manager((_plugin, "cuda")), device=None)


def test_a_missing_or_too_old_torchao_raises():
    specs = [dataclasses.replace(s, requires=("torchao>=99",)) if s.kind == "linear" else s
             for s in _plugin.kernels_core_kernels()]
    plugin = types.ModuleType("cuda_without_torchao")
    plugin.kernels_core_kernels = hookimpl(lambda: specs)
    message = _refused(_model(), _pm(plugin=plugin))
    assert "requirement missing: torchao" in message and "needs torchao>=99" in message


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_conformance_check_on_the_cpu(float8, recipe):
    _recipe_here(recipe)
    """The linear kind's conformance cases (``kernels-core check``), eager and traced, with the kernel declared for the
    CPU backend here: the same implementation, on torch's CPU float8 products."""
    from kernels_core.testing import assert_conforms

    spec = dataclasses.replace(_float8_specs.float8_kernel_specs("cpu")[["tensorwise", "rowwise"].index(recipe)],
                               capability=None)
    plugin = types.ModuleType("cpu_float8")
    plugin.kernels_core_kernels = hookimpl(lambda: [spec])
    report = assert_conforms("cpu_float8", plugin_manager=fresh_plugin_manager((plugin, "cpu_float8")))
    passed = [r for r in report.results if r.status == "pass"]
    assert len(passed) == 4 and any("compiled" in r.case for r in passed)
    assert max(r.error for r in passed) > 2e-2  # FP8 rounding shows: above any bf16 kernel's bound
