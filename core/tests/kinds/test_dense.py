"""The opt-in ``linear`` kind: which linears it takes, why it declines the others, and that nothing chooses its
kernels unless configuration names them (and then raises where they cannot serve).

The kernels here are stand-ins declared by test plugins: ``exact_linear`` is ``F.linear`` itself (outputs must
then be bit for bit the module's own), ``scaled_linear`` is off by 30% (what a conformance check must catch).
kernels-cuda's FP8 kernels are checked against bf16 in its own tests.
"""

from __future__ import annotations

import types

import kernels_core
import pytest
import torch
from kernels_core import BackendInfo
from kernels_core import DeviceInfo
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm
from torch import nn


transformers = pytest.importorskip("transformers")

CALLS: list[tuple[int, ...]] = []
COMPILED = Mode.TRAINING | Mode.TORCH_COMPILE
# hidden 48, MLP 80: q/o/gate/up/down projections are multiples of 16; k/v (2 heads x 12 = 24) are not.
SIZES = {"hidden_size": 48, "intermediate_size": 80, "head_dim": 12}


def exact_linear(input, weight, bias=None):
    CALLS.append(tuple(weight.shape))
    return torch.nn.functional.linear(input, weight, bias)


def scaled_linear(input, weight, bias=None):
    return 1.3 * torch.nn.functional.linear(input, weight, bias)


def _spec(kernel_id, impl="exact_linear", *, backend="cpu", priority=500, **extra):
    settings = dict(variants=("projection", "head"), dtypes=("bfloat16",),
                    supports=Supports.BACKWARD | Supports.TORCH_COMPILE, compile_only=True)
    settings.update(extra)
    return KernelSpec(id=kernel_id, kind="linear", backend=backend, impl=f"{__name__}:{impl}", priority=priority,
                      **settings)


def _plugin(specs, backends=()):
    module = types.ModuleType("plugin_linear_test")
    module.kernels_core_kernels = hookimpl(lambda: list(specs))
    if backends:
        module.kernels_core_detect_devices = hookimpl(lambda: list(backends))
    return module


@pytest.fixture
def linear_pm():
    CALLS.clear()
    # Not compile-only, and at a priority above every other kernel: still never chosen unless asked for.
    eager = _spec("cpu.linear.eager", compile_only=False, dtypes=("bfloat16", "float32"))
    return fresh_plugin_manager((_plugin([_spec("cpu.linear.exact"), eager]), "linear_test"))


def _request(*ids, key="any", **options):
    kind = {"prefer": {key: list(ids)}}
    if options:
        kind["options"] = options
    return {"kinds": {"linear": kind}}


def _model(dtype=torch.bfloat16, **overrides):
    return tiny_causal_lm("llama", dtype=dtype, **{**SIZES, **overrides})


def _rows(model):
    return {e.module: e for e in kernels_core.get_report(model).entries if e.kind == "linear"}


def _state(model):
    return {name: dict(module.__dict__) for name, module in model.named_modules()}


def test_never_visited_unless_configuration_names_its_kernels(linear_pm):
    model = _model()
    before = _state(model)
    for mode in (Mode.TRAINING, COMPILED):
        kernels_core.kernelize(model, mode=mode, strict=True, plugin_manager=linear_pm)
        assert _rows(model) == {}
        assert all("_kernels_core_binding" not in m.__dict__ for n, m in model.named_modules() if "proj" in n)
    kernels_core.unkernelize(model)
    assert _state(model) == before


def test_a_request_for_another_backend_chooses_nothing_here():
    """Asked for on backend 'sim' only: the CPU modules get no kernel, though a CPU one qualifies."""
    sim = BackendInfo("sim", "sim", (), priority=100)
    pm = fresh_plugin_manager((_plugin([_spec("cpu.linear.exact"), _spec("sim.linear.exact", backend="sim")], [sim]),
                               "linear_test"))
    model = kernels_core.kernelize(_model(), mode=COMPILED, config=_request("sim.linear.exact", key="sim"),
                                   plugin_manager=pm)
    rows = _rows(model)
    projections = [e for name, e in rows.items() if name.endswith(("q_proj", "gate_proj"))]
    assert projections and all(e.kernel is None for e in projections)
    assert all("opt-in kind: kinds.linear.prefer names no kernel for backend cpu" in e.reason for e in projections)


def test_requested_projections_run_the_kernel_and_the_others_say_why_not(linear_pm):
    model = _model()
    reference = _model()
    ids = torch.tensor([[3, 7, 11, 19, 23]])
    kernels_core.kernelize(model, mode=COMPILED, config=_request("cpu.linear.exact"), plugin_manager=linear_pm)
    rows = _rows(model)
    bound = {name for name, e in rows.items() if e.kernel == "cpu.linear.exact"}
    layers = range(2)
    projections = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert bound == {f"model.layers.{i}.{p}" for i in layers for p in projections}
    assert {rows[n].variant for n in bound} == {"projection"}
    for name in (f"model.layers.{i}.self_attn.{p}" for i in layers for p in ("k_proj", "v_proj")):
        assert rows[name].kernel is None
        assert "in_features 48 and out_features 24 must both be multiples of 16" in rows[name].reason
    assert "options = { lm_head = true } asks for it" in rows["lm_head"].reason
    assert "model.embed_tokens" not in rows
    CALLS.clear()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert len(CALLS) == len(bound)
    # The stand-in is F.linear itself: the model computes exactly what it computed before.
    with torch.no_grad():
        assert torch.equal(out, reference(input_ids=ids).logits)


def test_unkernelize_restores_every_linear(linear_pm):
    model = _model()
    before = _state(model)
    kernels_core.kernelize(model, mode=COMPILED, config=_request("cpu.linear.exact"), plugin_manager=linear_pm)
    assert model.model.layers[0].mlp.down_proj.__dict__.get("forward") is not None
    kernels_core.unkernelize(model)
    assert _state(model) == before


def test_lm_head_only_when_the_option_asks(linear_pm):
    model = kernels_core.kernelize(_model(vocab_size=112), mode=COMPILED,
                                   config=_request("cpu.linear.exact", lm_head=True), plugin_manager=linear_pm)
    row = _rows(model)["lm_head"]
    assert (row.kernel, row.variant) == ("cpu.linear.exact", "head")


def test_lm_head_option_unfuses_the_loss_so_the_head_kernel_runs(linear_pm):
    # The fused loss would read lm_head's weight itself and never call the bound kernel.
    model = kernels_core.kernelize(_model(vocab_size=112), mode=COMPILED,
                                   config=_request("cpu.linear.exact", lm_head=True), plugin_manager=linear_pm)
    loss_rows = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
    assert loss_rows and all(e.kernel is None for e in loss_rows)
    assert "options.lm_head asks for lm_head's own linear kernel" in loss_rows[0].reason
    CALLS.clear()
    ids = torch.tensor([[3, 7, 11, 19, 23]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert (112, 48) in CALLS  # lm_head's weight: its kernel ran in the training step


def test_option_type_is_checked(linear_pm):
    with pytest.raises(kernels_core.ConfigError, match="option 'lm_head' of kind 'linear' expects bool"):
        kernels_core.kernelize(_model(), mode=COMPILED, config=_request("cpu.linear.exact", lm_head="yes"),
                               plugin_manager=linear_pm)


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 16, bias=False)
        self.experts = nn.ModuleList([nn.Linear(32, 32, bias=False)])


class _Quantized(nn.Linear):
    def forward(self, x):
        return super().forward(x)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"moe": _Router(), "proj": nn.Linear(32, 48),
                                                    "own": _Quantized(32, 32)})])
        self.projector = nn.Linear(32, 32)  # outside the decoder layers: not the kind's

    def forward(self, x):
        layer = self.layers[0]
        return layer["proj"](x), layer["moe"].gate(x), layer["own"](x), self.projector(x)


def test_routers_own_forwards_and_linears_outside_layers(linear_pm):
    model = _Blocks().to(torch.bfloat16)
    kernels_core.kernelize(model, mode=COMPILED, config=_request("cpu.linear.exact"), plugin_manager=linear_pm)
    rows = _rows(model)
    assert rows["layers.0.proj"].kernel == "cpu.linear.exact"
    assert "MoE router" in rows["layers.0.moe.gate"].reason
    assert "_Quantized is a linear layer with its own forward" in rows["layers.0.own"].reason
    # An expert stored as a linear (older MoE layouts) is a projection like any other.
    assert rows["layers.0.moe.experts.0"].kernel == "cpu.linear.exact"
    assert "projector" not in rows


def test_peft_lora_layers_are_declined(linear_pm):
    peft = pytest.importorskip("peft", reason="PEFT is an optional extra (kernels-core[peft])")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=16, target_modules=["q_proj", "gate_proj"]))
    kernels_core.kernelize(model, mode=COMPILED, config=_request("cpu.linear.exact"), plugin_manager=linear_pm)
    rows = _rows(model)
    wrapped = [name for name in rows if ".q_proj." in name or ".gate_proj." in name]
    # base_layer, lora_A.default and lora_B.default of each wrapped projection.
    assert len(wrapped) == 2 * 2 * 3
    for name in wrapped:
        assert rows[name].kernel is None and "wrapped by PEFT's Linear" in rows[name].reason, name
    assert rows["base_model.model.model.layers.0.mlp.up_proj"].kernel == "cpu.linear.exact"


def _unchanged_after(model, call):
    before = _state(model)
    with pytest.raises(KernelizeError) as raised:
        call()
    assert _state(model) == before
    return str(raised.value)


def test_an_explicit_request_that_cannot_be_served_raises_and_changes_nothing(linear_pm):
    model = _model()
    request = _request("cpu.linear.exact")
    eager = _unchanged_after(model, lambda: kernels_core.kernelize(model, mode=Mode.TRAINING, config=request,
                                                                   plugin_manager=linear_pm))
    assert "runs only under torch.compile" in eager
    model32 = _model(dtype=torch.float32)
    dtype = _unchanged_after(model32, lambda: kernels_core.kernelize(model32, mode=COMPILED, config=request,
                                                                     plugin_manager=linear_pm))
    assert "dtype unsupported: handles ['bfloat16'], module is float32" in dtype
    elsewhere = _request("cuda.linear.float8_rowwise")
    gpu_pm = fresh_plugin_manager((_plugin([_spec("cuda.linear.float8_rowwise", backend="cuda")]), "gpu"))
    cpu = _unchanged_after(model, lambda: kernels_core.kernelize(model, mode=COMPILED, config=elsewhere,
                                                                 plugin_manager=gpu_pm))
    assert "runs on backend cuda, module is on cpu" in cpu


def test_a_gpu_older_than_the_kernel_needs_raises():
    old_gpu = BackendInfo("sim", "sim", (DeviceInfo(0, "simulated Ampere", capability=(8, 0)),), priority=100)
    spec = _spec("sim.linear.fp8", backend="sim", capability=kernels_core.CapabilityRange(min=(8, 9)))
    pm = fresh_plugin_manager((_plugin([spec], [old_gpu]), "sim"))
    model = _model()
    message = _unchanged_after(model, lambda: kernels_core.kernelize(
        model, mode=COMPILED, device="sim", config=_request("sim.linear.fp8"), plugin_manager=pm))
    assert "capability out of range: device is 8.0, kernel needs 8.9-999.999" in message


def test_conformance_cases_pass_the_exact_kernel_and_catch_a_wrong_one():
    from kernels_core._check import check

    pm = fresh_plugin_manager((_plugin([_spec("cpu.linear.exact"), _spec("cpu.linear.scaled", "scaled_linear")]),
                               "linear_test"))
    report = check(["linear_test"], plugin_manager=pm, compile=False)
    status = {(r.kernel, r.case): r.status for r in report.results if r.case != "variant head"}
    assert len(status) == 4
    assert {s for (k, _), s in status.items() if k == "cpu.linear.exact"} == {"pass"}
    assert {s for (k, _), s in status.items() if k == "cpu.linear.scaled"} == {"fail"}
    # The lm_head is the kind's only where configuration asks; the check has no case for it and says so.
    head = [r for r in report.results if r.case == "variant head"]
    assert len(head) == 2 and all(r.status == "skipped" for r in head)

