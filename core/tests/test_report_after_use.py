"""The report stays true after what users do to a kernelized model: wrap and unwrap it, convert it, move it, copy it.

Every call of a bound forward checks the module's parameters against what its kernels declare (dtypes, and the
device type kernelize bound them for); where a kernel no longer serves them the module's own forward runs, a
KernelFallbackWarning says so once per kernel and cause, and get_report shows the entry as fallen back, with the
reason. Each test checks the report against what really runs: the reference plugin's kernels count their calls.
"""

from __future__ import annotations

import copy
import re
import types
import warnings
from collections import Counter

import kernels_core
import pytest
import reference_plugin
import torch
from kernels_core import BackendInfo
from kernels_core import DeviceInfo
from kernels_core import KernelFallbackWarning
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import reference
from kernels_core.testing import tiny_causal_lm
from round_trips import round_trip


transformers = pytest.importorskip("transformers")

IDS = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
BINDING_ATTR = "_kernels_core_binding"


def _expected_calls(report, *, backward: bool = False) -> Counter:
    """Reference-kernel calls per kind that one forward runs if the report is true (the loss only with labels); with
    ``backward``, a training step's: a gated MLP's kernel runs again in backward, where down_proj gets act(gate) * up
    back from it (recompute_product)."""
    calls = Counter(e.kind for e in report.applied if e.kernel.startswith("ref."))
    if backward:
        calls.update({kind: n for kind, n in calls.items() if kind.endswith("gated_mlp")})
    return calls


def _step(model, mode):
    """One training step (loss and every gradient) or one evaluation forward (logits)."""
    if Mode.TRAINING in mode:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits, {}


def _fallback_warnings(record) -> Counter:
    """Kernel id -> number of KernelFallbackWarnings naming it."""
    return Counter(re.match(r"kernel '([^']+)'", str(w.message)).group(1) for w in record
                   if issubclass(w.category, KernelFallbackWarning))


def _declared(pm) -> dict[str, tuple[str, ...]]:
    return {provided.spec.id: provided.spec.dtypes for provided in pm.kernels()}


# --- Wrappers: PEFT holds the kernelized model as a sub-module ---------------------------------------------------

def _lora():
    peft = pytest.importorskip("peft", reason="PEFT is an optional extra (kernels-core[peft])")
    # Non-zero LoRA weights, on projections the kernels call as sub-modules (attention, gated MLP).
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)


def test_unkernelize_through_a_peft_wrapper_clears_the_inner_report(ref_pm, calls):
    peft = pytest.importorskip("peft", reason="PEFT is an optional extra (kernels-core[peft])")
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    wrapped = peft.get_peft_model(model, _lora())
    # LoRA wraps the projections the kernels call: every binding stays, and the report with it.
    assert kernels_core.get_report(model) is report
    calls.clear()
    wrapped(input_ids=IDS, labels=IDS).loss.backward()
    assert calls == _expected_calls(report)

    kernels_core.unkernelize(wrapped)
    assert kernels_core.get_report(model) is None, "unkernelize through the wrapper restored the model's modules"
    assert kernels_core.get_report(wrapped) is None
    merged = wrapped.merge_and_unload()
    assert merged is model and kernels_core.get_report(merged) is None
    assert not any(BINDING_ATTR in m.__dict__ for m in merged.modules())
    calls.clear()
    merged(input_ids=IDS, labels=IDS)
    assert not calls


def test_a_report_on_a_peft_wrapper_stays_true_through_merge_and_unkernelize(ref_pm, calls):
    peft = pytest.importorskip("peft", reason="PEFT is an optional extra (kernels-core[peft])")
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    wrapped = peft.get_peft_model(model, _lora())
    kernels_core.kernelize(wrapped, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    # The second call replaced the bindings the inner model's own report described.
    assert kernels_core.get_report(model) is None
    report = kernels_core.get_report(wrapped)
    assert report.applied and all(e.module.startswith("base_model.model") for e in report.entries)
    before, _ = _step(wrapped, Mode.INFERENCE)

    merged = wrapped.merge_and_unload()
    # Merging folds LoRA into the projections; the kernelized modules and their bindings are untouched.
    assert kernels_core.get_report(wrapped) is report
    calls.clear()
    after, _ = _step(merged, Mode.INFERENCE)
    assert calls == _expected_calls(report)
    assert_close(after, before, what="merged LoRA")

    kernels_core.unkernelize(merged)
    now = kernels_core.get_report(wrapped)
    assert not now.applied and not now.covered
    bound = {e.kernel for e in report.applied} | {e.covered_by for e in report.covered}
    fell = [e for e in now.entries if e.fell_back]
    assert {e.fell_back for e in fell} == bound
    assert len(fell) == len(report.applied) + len(report.covered)
    assert all("binding was removed since kernelize" in e.reason for e in fell)
    assert f"{len(fell)} fell back to their own forward" in now.summary()
    calls.clear()
    _step(merged, Mode.INFERENCE)
    assert not calls


def test_unkernelizing_part_of_a_model_shows_in_the_report(ref_pm, calls):
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    kernels_core.unkernelize(model.model.layers[0])
    now = kernels_core.get_report(model)
    for old, new in zip(report.entries, now.entries, strict=True):
        in_layer = old.module == "model.layers.0" or old.module.startswith("model.layers.0.")
        if in_layer and (old.applied or old.covered):
            assert new.fell_back == (old.kernel or old.covered_by) and not new.applied and not new.covered
            assert "binding was removed" in new.reason
        else:
            assert new == old
    calls.clear()
    _step(model, Mode.INFERENCE)
    assert calls == _expected_calls(now)


def test_layers_compiled_in_place_after_kernelize_keep_their_report(ref_pm, calls):
    # The FSDP2 recipe: kernelize, then each decoder layer replaced by torch.compile(layer), whose forward calls the
    # kernelized layer. The report looks through the wrapper; the kernels bound on the layer itself still run.
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=ref_pm)
    before = kernels_core.get_report(model).entries
    assert any(e.module == "model.layers.0" and e.applied for e in before), "a kernel bound on the layer itself"
    layers = model.model.layers
    for index, layer in enumerate(layers):
        layers[index] = torch.compile(layer)
    assert kernels_core.get_report(model).entries == before


# --- Dtype conversions after kernelize ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE], ids=["training", "inference"])
@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.float64)], ids=["double", "to"])
def test_float64_runs_the_own_forward_where_no_kernel_declares_it_and_says_so(ref_pm, calls, convert, mode):
    model = tiny_causal_lm("llama")
    eager = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=mode, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    declared = _declared(ref_pm)
    undeclared = {e.kernel for e in report.applied if "float64" not in declared[e.kernel]}
    assert {e.kernel for e in report.applied if e.kernel.startswith("ref.")} <= undeclared
    convert(model)
    convert(eager)
    calls.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, grads = _step(model, mode)
        _step(model, mode)
    assert not calls, "no reference kernel declares float64: none may run"
    # One warning per kernel and cause, not per module or call.
    assert _fallback_warnings(record) == Counter(undeclared)
    assert all("float64" in str(w.message) for w in record if issubclass(w.category, KernelFallbackWarning))
    # The modules' own forwards ran: the eager model's float64 results, to float64 rounding.
    expected, eager_grads = _step(eager, mode)
    assert_close(out, expected, what="float64 output")
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name], what=f"float64 gradient of {name}")

    now = kernels_core.get_report(model)
    assert {e.kernel for e in now.applied} == {e.kernel for e in report.applied} - undeclared
    for old, new in zip(report.entries, now.entries, strict=True):
        kernel = old.kernel or old.covered_by
        if kernel in undeclared:
            assert new.fell_back == kernel and not new.applied and not new.covered
            assert "float64 now" in new.reason and ", ".join(declared[kernel]) in new.reason
        else:
            assert new == old
    assert "fell back to their own forward since kernelize" in now.summary()
    assert "float64 now" in now.table() and '"fell_back"' in now.to_json()

    # Back to float32: the kernels run again, silently, and the report is kernelize's again.
    model.float()
    assert kernels_core.get_report(model) is report
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        _step(model, mode)
    assert calls == _expected_calls(report, backward=Mode.TRAINING in mode) and calls


def fp32_rms_norm(x, weight, *, eps, offset, casting):
    FP32_CALLS["rms_norm"] += 1
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)


FP32_CALLS: Counter = Counter()
FP32_ONLY = KernelSpec(id="test.rms_norm.fp32", kind="rms_norm", variants=("standard", "offset"), backend="any",
                       impl=f"{__name__}:fp32_rms_norm", priority=100, dtypes=("float32",),
                       supports=Supports.BACKWARD | Supports.TORCH_COMPILE)


def _plugin(name, specs, backends=()):
    module = types.ModuleType(f"plugin_{name}")
    module.kernels_core_kernels = hookimpl(lambda: list(specs))
    if backends:
        module.kernels_core_detect_devices = hookimpl(lambda: list(backends))
    return module


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["half", "bfloat16"])
def test_half_precision_falls_back_only_where_the_kernel_does_not_declare_it(calls, dtype):
    FP32_CALLS.clear()
    pm = fresh_plugin_manager((reference_plugin, "reference"), (_plugin("fp32only", [FP32_ONLY]), "fp32only"))
    model = tiny_causal_lm("llama")
    eager = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    report = kernels_core.get_report(model)
    norms = [e.module for e in report.applied if e.kernel == FP32_ONLY.id]
    assert len(norms) == 3  # two input norms and the final norm; the post-attention norms are covered
    if dtype is torch.float16:
        model.half()
        eager.half()
    else:
        model.to(dtype)
        eager.to(dtype)
    calls.clear()
    FP32_CALLS.clear()  # kernelize ran the kernel once on its probe's inputs (the output check)
    with pytest.warns(KernelFallbackWarning) as record:
        out, _ = _step(model, Mode.INFERENCE)
        _step(model, Mode.INFERENCE)
    assert _fallback_warnings(record) == Counter({FP32_ONLY.id: 1})
    name = str(dtype).removeprefix("torch.")
    assert f"{name} now" in str(record[0].message)
    assert not FP32_CALLS, "the float32-only kernel must not run on half-precision parameters"
    now = kernels_core.get_report(model)
    assert calls == Counter({k: 2 * n for k, n in _expected_calls(now).items()}) and calls["residual_rms_norm"]
    assert [e.module for e in now.entries if e.fell_back] == norms
    assert all(f"{name} now, and {FP32_ONLY.id} declares float32" in e.reason for e in now.entries if e.fell_back)
    # The reference kernels compute the same math as the modules they replace, in another order: the eager model's
    # logits to half-precision rounding (tolerance() of the dtype, relative to the largest logit).
    expected, _ = _step(eager, Mode.INFERENCE)
    assert out.dtype == dtype
    assert_close(out, expected, what=f"{name} logits")


def test_a_kernel_returning_another_dtype_after_a_conversion_falls_back_instead_of_crashing():
    # mistaken_plugins.Float32Out: right in float32, where kernelize checked it; on bfloat16 parameters it returns
    # float32, which the next bfloat16 Linear refuses ("expected m1 and m2 to have the same dtype").
    import mistaken_plugins

    pm = fresh_plugin_manager((mistaken_plugins.Float32Out(), "acme"))
    model = tiny_causal_lm("llama")
    eager = copy.deepcopy(model).to(torch.bfloat16)
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    norms = [e.module for e in kernels_core.get_report(model).applied if e.kernel == "acme.rms_norm.f32"]
    assert norms
    model.to(torch.bfloat16)
    with pytest.warns(KernelFallbackWarning) as record:
        out, _ = _step(model, Mode.INFERENCE)
        _step(model, Mode.INFERENCE)
    assert _fallback_warnings(record) == Counter({"acme.rms_norm.f32": 1})
    message = str(record[0].message)
    assert "returns float32" in message and "bfloat16" in message
    now = kernels_core.get_report(model)
    assert [e.module for e in now.entries if e.fell_back] == norms
    assert all("returns float32" in e.reason for e in now.entries if e.fell_back)
    expected, _ = _step(eager, Mode.INFERENCE)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, what="bfloat16 logits")


def test_a_kernel_keeping_the_dtype_after_a_conversion_keeps_running(calls):
    # The same conversion with a kernel that follows its input's dtype: checked once, then it runs, silently.
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=fresh_plugin_manager(
        (reference_plugin, "reference")))
    report = kernels_core.get_report(model)
    model.to(torch.bfloat16)
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        _step(model, Mode.INFERENCE)
        _step(model, Mode.INFERENCE)
    assert calls == Counter({k: 2 * n for k, n in _expected_calls(report).items()}) and calls
    assert kernels_core.get_report(model) is report


# --- torch.compile -----------------------------------------------------------------------------------------------

def test_a_compiled_model_converted_after_kernelize_traces_the_fallback_in_one_graph(ref_pm, calls):
    torch._dynamo.reset()
    model = tiny_causal_lm("qwen3")
    eager = copy.deepcopy(model).double()
    kernels_core.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=ref_pm)
    model.double()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    calls.clear()
    out = compiled(input_ids=IDS, labels=IDS)
    out.loss.backward()
    assert not calls
    expected = eager(input_ids=IDS, labels=IDS)
    expected.loss.backward()
    assert_close(out.loss, expected.loss)
    assert_close(model.model.norm.weight.grad, eager.model.norm.weight.grad)
    now = kernels_core.get_report(model)
    assert not [e for e in now.applied if e.kernel.startswith("ref.")]


# --- A kernel configuration asked for raises instead ------------------------------------------------------------

def test_a_preferred_kernel_raises_where_it_cannot_run_and_the_report_says_so(ref_pm, calls):
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm,
                           config={"kinds": {"rms_norm": {"prefer": {"cpu": ["ref.rms_norm"]}}}})
    model.double()
    calls.clear()
    # The kernels picked automatically that run before the first norm fall back and warn.
    with pytest.raises(KernelizeError, match=r"'ref.rms_norm', preferred by configuration, cannot run on module "
                                             r"'model.layers.0.input_layernorm'.*float64 now"), \
            pytest.warns(KernelFallbackWarning) as record:
        _step(model, Mode.INFERENCE)
    assert "ref.rms_norm" not in _fallback_warnings(record)
    assert not calls
    rows = [e for e in kernels_core.get_report(model).entries if e.fell_back == "ref.rms_norm" and not e.covered_by]
    assert len(rows) == 3 and all("each call raises KernelizeError" in e.reason for e in rows)


# --- Device moves -----------------------------------------------------------------------------------------------

def cpu_layer_norm(x, weight, bias, *, eps):
    DEVICE_CALLS["layer_norm"] += 1
    return reference.layer_norm(x, weight, bias, eps=eps)


DEVICE_CALLS: Counter = Counter()


def _layer_norm_pm(backend, backends=()):
    spec = KernelSpec(id=f"{backend}.layer_norm.test", kind="layer_norm", variants=("bias", "no_bias"),
                      backend=backend, impl=f"{__name__}:cpu_layer_norm", dtypes=("float32",))
    return fresh_plugin_manager((_plugin("device", [spec], backends), "device")), spec.id


def test_moving_to_another_device_type_runs_the_own_forward_and_says_so():
    DEVICE_CALLS.clear()
    pm, kernel_id = _layer_norm_pm("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    report = kernels_core.get_report(model)
    assert [e.kernel for e in report.applied] == [kernel_id]
    DEVICE_CALLS.clear()  # kernelize ran the kernel once on its probe's inputs (the output check)
    model.to("meta")
    with pytest.warns(KernelFallbackWarning, match=r"parameters are on meta now.*bound for cpu tensors"):
        out = model(torch.randn(2, 8, device="meta"))
    assert out.device.type == "meta" and not DEVICE_CALLS, "a CPU kernel must not run on another device"
    (entry,) = kernels_core.get_report(model).entries
    assert entry.fell_back == kernel_id and "on meta now" in entry.reason
    model.to_empty(device="cpu")
    assert kernels_core.get_report(model) is report
    model(torch.randn(2, 8))
    assert DEVICE_CALLS["layer_norm"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to move a CUDA-bound model off it")
def test_gpu_a_cuda_kernel_moved_to_the_cpu_falls_back_to_the_own_forward():
    DEVICE_CALLS.clear()
    cuda = [BackendInfo("cuda", "cuda", (DeviceInfo(0, torch.cuda.get_device_name(0)),), priority=10)]
    pm, kernel_id = _layer_norm_pm("cuda", cuda)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).cuda()
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    x = torch.randn(2, 8)
    model(x.cuda())
    assert DEVICE_CALLS["layer_norm"] == 1
    eager = kernels_core.unkernelize(copy.deepcopy(model)).cpu()
    model.cpu()
    with pytest.warns(KernelFallbackWarning, match="parameters are on cpu now"):
        out = model(x)
    assert DEVICE_CALLS["layer_norm"] == 1
    assert_close(out, eager(x))
    (entry,) = kernels_core.get_report(model).entries
    assert entry.fell_back == kernel_id and "on cpu now" in entry.reason


# --- Copies ------------------------------------------------------------------------------------------------------



@pytest.mark.parametrize("how", ["deepcopy", "torch_save", "pickle"])
def test_copies_keep_the_report_and_their_own_bindings(ref_installed, calls, how):
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_installed)
    report = kernels_core.get_report(model)
    clone = round_trip(model, how)
    assert kernels_core.get_report(clone) == report
    calls.clear()
    expected, _ = _step(clone, Mode.INFERENCE)
    assert calls == _expected_calls(report)

    # The copy's forwards check the copy's parameters: converting it leaves the original's kernels running.
    clone.double()
    now = kernels_core.get_report(clone)
    assert not [e for e in now.applied if e.kernel.startswith("ref.")]
    assert kernels_core.get_report(model) is report
    calls.clear()
    with pytest.warns(KernelFallbackWarning):
        _step(clone, Mode.INFERENCE)
    assert not calls
    got, _ = _step(model, Mode.INFERENCE)
    assert calls == _expected_calls(report)
    assert torch.equal(got, expected)

    kernels_core.unkernelize(clone)
    assert kernels_core.get_report(clone) is None
    assert kernels_core.get_report(model) is report
