"""kernelize / unkernelize semantics: resolution, configuration, modes, atomicity, reversibility, portability."""

from __future__ import annotations

import copy
import io
import json
import logging
import types

import kernels_core
import pytest
import torch
from kernels_core import BackendInfo
from kernels_core import ConfigError
from kernels_core import DeviceInfo
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")

CALLS: list[str] = []


def _tagged_rms_norm(tag):
    def rms_norm(x, weight, *, eps, offset, casting):
        CALLS.append(tag)
        return kernels_core.testing.reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)
    return rms_norm


low_rms_norm = _tagged_rms_norm("low")
high_rms_norm = _tagged_rms_norm("high")
alpha_rms_norm = _tagged_rms_norm("alpha")
beta_rms_norm = _tagged_rms_norm("beta")


def _plugin(name, specs=(), backends=(), **extra_hooks):
    module = types.ModuleType(f"plugin_{name}")
    if specs:
        module.kernels_core_kernels = hookimpl(lambda: list(specs))
    if backends:
        module.kernels_core_detect_devices = hookimpl(lambda: list(backends))
    for hook_name, fn in extra_hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    return module


def _rms(kernel_id, impl, priority, *, backend="cpu", variants=("standard", "offset"), supports=None):
    return KernelSpec(id=kernel_id, kind="rms_norm", variants=variants, backend=backend,
                      impl=f"{__name__}:{impl}", priority=priority,
                      supports=supports if supports is not None else Supports.BACKWARD | Supports.TORCH_COMPILE)


LOW = _rms("low.rms_norm", "low_rms_norm", 20)
HIGH = _rms("high.rms_norm", "high_rms_norm", 30)


@pytest.fixture
def two_pm():
    CALLS.clear()
    return fresh_plugin_manager((_plugin("low", [LOW]), "low"), (_plugin("high", [HIGH]), "high"))


def _kernels(model, kind="rms_norm"):
    """The kernels of one kind, or None for modules left without one (covered modules are neither)."""
    return {e.kernel for e in kernels_core.get_report(model).entries if e.kind == kind and not e.covered}


def _snapshot(model):
    return {name: dict(module.__dict__) for name, module in model.named_modules()}


def test_priority_decides_between_two_plugins(two_pm):
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=two_pm)
    assert _kernels(model) == {"high.rms_norm"}
    model(input_ids=torch.tensor([[3, 4, 5]]))
    assert set(CALLS) == {"high"}


def test_config_pin_overrides_priority_and_bad_pin_raises_with_alternatives(two_pm):
    config = {"kinds": {"rms_norm": {"prefer": {"cpu": ["low.rms_norm"]}}}}
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, config=config, plugin_manager=two_pm)
    assert _kernels(model) == {"low.rms_norm"}
    assert all(e.note == "preferred by config" for e in kernels_core.get_report(model).applied if e.kind == "rms_norm")
    model = tiny_causal_lm("llama")
    before = _snapshot(model)
    bad = {"kinds": {"rms_norm": {"prefer": {"cpu": ["nope.rms_norm"]}}}}
    # A list naming no installed kernel is one configuration error, with its source and the closest installed id.
    with pytest.raises(kernels_core.ConfigError, match=r"^config argument: kinds\.rms_norm\.prefer\.cpu: "
                                                       r"'nope\.rms_norm' matches no installed kernel; did you mean "
                                                       r"'low\.rms_norm'\?"):
        kernels_core.kernelize(model, mode=Mode.INFERENCE, config=bad, plugin_manager=two_pm)
    assert _snapshot(model) == before


def test_config_disables_kernels_and_plugins(two_pm):
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=two_pm,
                                   config={"kernels": {"disable": ["high.rms_norm"]}})
    assert _kernels(model) == {"low.rms_norm"}
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=two_pm,
                                   config={"kinds": {"rms_norm": {"disable": ["high"]}}})
    assert _kernels(model) == {"low.rms_norm"}
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=two_pm,
                                   config={"plugins": {"block": ["high", "low"]}})
    assert _kernels(model) == {"any.rms_norm.recompute"}
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=two_pm,
                                   config={"kinds": {"rms_norm": {"enabled": False}}})
    entries = [e for e in kernels_core.get_report(model).entries if e.kind == "rms_norm" and not e.covered]
    assert entries and all(e.kernel is None and "disabled by config" in e.reason for e in entries)


def test_config_errors_name_key_and_allowed_values(two_pm):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['prefered'\].*allowed"):
        kernels_core.kernelize(tiny_causal_lm("llama"), config={"kinds": {"rms_norm": {"prefered": {}}}},
                               plugin_manager=two_pm)
    with pytest.warns(kernels_core.ConfigWarning, match=r"unknown layer kind 'rmsnorm'.*'rms_norm'"):
        kernels_core.kernelize(tiny_causal_lm("llama"), config={"kinds": {"rmsnorm": {}}}, plugin_manager=two_pm)


def test_a_better_ranked_kernel_of_another_variant_is_not_reported_as_passed_over():
    # The offset-only kernel ranks first but was never a candidate for Llama's standard norms: the row of the kernel
    # chosen says nothing fell back. A better-ranked kernel of the same variant that cannot run (here: not in
    # training) is still named.
    offset_only = _rms("cpu.rms_norm.offset", "high_rms_norm", 90, variants=("offset",))
    inference_only = _rms("cpu.rms_norm.infer", "high_rms_norm", 80, supports=Supports.NONE)
    pm = fresh_plugin_manager((_plugin("both", [offset_only, inference_only, LOW]), "both"), portable=False)
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.TRAINING, plugin_manager=pm)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "rms_norm" and e.kernel]
    assert rows and all(e.kernel == "low.rms_norm" for e in rows)
    for row in rows:
        assert "cpu.rms_norm.offset" not in (row.note or ""), row.note
        assert row.note.startswith("fell back: cpu.rms_norm.infer: mode unsupported"), row.note


def test_strict_raises_for_matched_modules_whose_backend_kernels_cannot_serve_them():
    # A CPU rms_norm kernel exists but handles only the offset variant, and no residual kernel covers the
    # post-attention norms: Llama's five standard norms could have had a kernel on their backend and got none.
    # Kinds with no CPU kernel at all, like rotary, never count.
    offset_only = _rms("cpu.rms_norm.offset", "high_rms_norm", 90, variants=("offset",))
    pm = fresh_plugin_manager((_plugin("offset", [offset_only]), "offset"), portable=False)
    model = tiny_causal_lm("llama")
    before = _snapshot(model)
    with pytest.raises(KernelizeError, match=r"strict kernelize: 5 matched module\(s\) got no kernel: "
                                             r"model\.layers\.0\.input_layernorm \(rms_norm\): cpu\.rms_norm\.offset: "
                                             r"variant unsupported"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, strict=True, plugin_manager=pm)
    assert _snapshot(model) == before
    with pytest.raises(KernelizeError, match="rms_norm"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm,
                               config={"kinds": {"rms_norm": {"strict": True}}})
    assert _snapshot(model) == before
    # Strict on a kind with no kernel for the backend, or on one fully served, passes.
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm,
                           config={"kinds": {"rotary_embedding": {"strict": True}}})
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=fresh_plugin_manager(),
                           config={"kinds": {"rms_norm": {"strict": True}}})


def test_modes_filter_kernels_by_declared_support():
    infer_only = _rms("infer.rms_norm", "high_rms_norm", 90, supports=Supports.NONE)
    no_compile = _rms("eager.rms_norm", "low_rms_norm", 80, supports=Supports.BACKWARD)
    pm = fresh_plugin_manager((_plugin("modes", [infer_only, no_compile]), "modes"))
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    assert _kernels(model) == {"infer.rms_norm"}
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    assert _kernels(model) == {"eager.rms_norm"}
    kernels_core.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=pm)
    assert _kernels(model) == {"any.rms_norm.recompute"}
    notes = {e.note for e in kernels_core.get_report(model).applied if e.kind == "rms_norm"}
    assert len(notes) == 1 and "infer.rms_norm: mode unsupported" in notes.pop()
    model.eval()
    kernels_core.kernelize(model, plugin_manager=pm)
    assert kernels_core.get_report(model).mode == "INFERENCE"


COMPILED_INFERENCE = Mode.INFERENCE | Mode.TORCH_COMPILE


def test_kernels_native_when_compiled_leave_their_modules_to_torch_compile():
    native = KernelSpec(id="native.rms_norm", kind="rms_norm", variants=("standard", "offset"), backend="cpu",
                        impl=f"{__name__}:high_rms_norm", priority=90,
                        supports=Supports.BACKWARD | Supports.TORCH_COMPILE, native_when_compiled=COMPILED_INFERENCE)
    pm = fresh_plugin_manager((_plugin("native", [native, LOW]), "native"))
    model = tiny_causal_lm("llama").eval()
    kernels_core.kernelize(model, mode=COMPILED_INFERENCE, strict=True, plugin_manager=pm)
    report = kernels_core.get_report(model)
    rows = [e for e in report.entries if e.kind == "rms_norm"]
    assert rows
    assert all(e.kernel is None and e.reason.startswith("left to torch.compile: native.rms_norm") for e in rows)
    assert all(e.left_to_compiler == "native.rms_norm" for e in rows)
    # Neither the lower-ranked kernel nor anything else takes its place: the modules keep their own forward.
    assert all("forward" not in m.__dict__ for m in model.modules() if type(m).__name__ == "LlamaRMSNorm")
    left = [e for e in report.entries if e.left_to_compiler]
    assert all(e.reason.startswith("left to torch.compile") for e in left)
    assert f"{len(left)} left to torch.compile" in report.summary()
    for mode in (Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE):
        kernels_core.kernelize(model, mode=mode, plugin_manager=pm)
        assert _kernels(model) == {"native.rms_norm"}, mode
    # An explicit preference is honoured: the user asked for the binding.
    prefer = {"kinds": {"rms_norm": {"prefer": {"cpu": ["native.rms_norm"]}}}}
    kernels_core.kernelize(model, mode=COMPILED_INFERENCE, config=prefer, plugin_manager=pm)
    assert _kernels(model) == {"native.rms_norm"}


def _guards_and_breaks(model, ids):
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(input_ids=ids)
    return len(explained.out_guards), explained.graph_break_count


def test_compiled_inference_adds_no_guards_where_kernels_would_trace_native_math():
    # Dynamo checks every guard on every call; in a CUDA-graphed decoding step that check is most of the host
    # time, so a binding that changes nothing in the graph must not add any.
    ids = torch.randint(3, 100, (1, 5))
    plain = _guards_and_breaks(tiny_causal_lm("qwen3").eval(), ids)
    no_mask = {"kinds": {"causal_mask": {"enabled": False}}}  # the one kind here that changes the graph
    compiled = kernels_core.kernelize(tiny_causal_lm("qwen3").eval(), mode=COMPILED_INFERENCE, config=no_mask)
    assert _guards_and_breaks(compiled, ids) == plain
    eager = kernels_core.kernelize(tiny_causal_lm("qwen3").eval(), mode=Mode.INFERENCE, config=no_mask)
    guards, breaks = _guards_and_breaks(eager, ids)
    assert breaks == 0 and guards > plain[0], "bound forwards are guarded: the comparison above can fail"


def test_invalid_modes_are_rejected(pm):
    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="mutually exclusive"):
        kernels_core.kernelize(model, mode=Mode.INFERENCE | Mode.TRAINING, plugin_manager=pm)
    with pytest.raises(ValueError, match="must contain Mode.INFERENCE or Mode.TRAINING"):
        kernels_core.kernelize(model, mode=Mode.TORCH_COMPILE, plugin_manager=pm)
    with pytest.raises(TypeError, match="kernels_core.Mode"):
        kernels_core.kernelize(model, mode="training", plugin_manager=pm)


def test_variant_negative_offset_norm_gets_no_standard_only_kernel():
    standard_only = _rms("std.rms_norm", "high_rms_norm", 90, variants=("standard",))
    pm = fresh_plugin_manager((_plugin("std", [standard_only]), "std"), portable=False)
    gemma = kernels_core.kernelize(tiny_causal_lm("gemma"), mode=Mode.INFERENCE, plugin_manager=pm)
    rows = [e for e in kernels_core.get_report(gemma).entries if e.kind == "rms_norm"]
    assert rows and all(e.kernel is None and "variant unsupported" in e.reason and e.variant == "offset"
                        for e in rows)
    llama = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=pm)
    assert _kernels(llama) == {"std.rms_norm"}


def test_per_device_choice_under_a_simulated_device_map(monkeypatch):
    """Two accelerator backends, each claiming one of two simulated devices; layers are placed like device_map.

    Tensors stay on the CPU (this machine has no accelerator); only the device each module reports is simulated.
    """
    alpha = _rms("alpha.rms_norm", "alpha_rms_norm", 100, backend="alpha")
    beta = _rms("beta.rms_norm", "beta_rms_norm", 100, backend="beta")
    backends_a = [BackendInfo("alpha", "cuda", (DeviceInfo(0, "sim-0", capability=(9, 0)),), priority=100)]
    backends_b = [BackendInfo("beta", "cuda", (DeviceInfo(1, "sim-1", capability=(8, 0)),), priority=100)]
    pm = fresh_plugin_manager((_plugin("alpha", [alpha], backends_a), "alpha"),
                              (_plugin("beta", [beta], backends_b), "beta"))
    model = tiny_causal_lm("llama")
    placement = {id(m): torch.device("cuda", 0) for m in model.model.layers[0].modules()}
    placement.update({id(m): torch.device("cuda", 1) for m in model.model.layers[1].modules()})
    placement[id(model.model.norm)] = torch.device("cuda", 1)
    from kernels_core import _resolve

    real = _resolve._device
    monkeypatch.setattr(_resolve, "_device", lambda m: placement.get(id(m), real(m)))
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    chosen = {e.module: (e.backend, e.kernel) for e in kernels_core.get_report(model).entries if e.kind == "rms_norm"}
    assert chosen["model.layers.0.input_layernorm"] == ("alpha", "alpha.rms_norm")
    assert chosen["model.layers.1.input_layernorm"] == ("beta", "beta.rms_norm")
    assert chosen["model.norm"] == ("beta", "beta.rms_norm")
    with pytest.raises(KernelizeError, match="no installed plugin detected it"):
        kernels_core.kernelize(model, device="npu", plugin_manager=pm)


def test_rollback_when_a_bind_fails_midway():
    seen = []

    def kernels_core_bind_kernel(module, match, kernel, forward):
        seen.append(kernel.id)
        if len(seen) == 3:
            raise RuntimeError("cannot bind the third one")
        return None

    plugin = _plugin("flaky", [HIGH], kernels_core_bind_kernel=kernels_core_bind_kernel)
    pm = fresh_plugin_manager((plugin, "flaky"))
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=fresh_plugin_manager())
    before = _snapshot(model)
    report_before = kernels_core.get_report(model)
    with pytest.raises(KernelizeError, match="plugin 'flaky'.*failed to bind kernel high.rms_norm.*third"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    assert len(seen) == 3
    assert _snapshot(model) == before, "a failed kernelize must leave every module exactly as it was"
    assert kernels_core.get_report(model) is report_before


def test_unkernelize_restores_every_module_exactly(ref_pm):
    model = tiny_causal_lm("qwen3_moe")
    ids = torch.randint(3, 100, (2, 7))
    before = _snapshot(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert model.state_dict().keys() == state.keys()
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)  # again: re-resolves
    kernels_core.unkernelize(model)
    assert _snapshot(model) == before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, eager)
    assert kernels_core.get_report(model) is None


@pytest.mark.parametrize("action", ["unkernelize", "kernelize"])
def test_a_wrapper_added_after_kernelize_is_never_dropped(ref_pm, action):
    # accelerate's mixed precision wraps the instance forward it finds, here the one kernelize bound; restoring
    # the forward kernelize saw would silently drop that wrapper.
    convert_outputs_to_fp32 = pytest.importorskip("accelerate.utils.operations").convert_outputs_to_fp32
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    bound = model.forward
    model.forward = convert_outputs_to_fp32(bound)
    wrapped = model.forward
    before = _snapshot(model)
    with pytest.raises(KernelizeError) as raised:
        if action == "kernelize":
            kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
        else:
            kernels_core.unkernelize(model)
    message = str(raised.value)
    assert f"{action} would drop code that wrapped the model" in message
    assert "'(model)' (LlamaForCausalLM).forward" in message and "convert_outputs_to_fp32" in message
    assert "Nothing was changed" in message
    assert _snapshot(model) == before and model.forward is wrapped
    # An accelerate hook added after kernelize moves the bound forward to _old_forward: refused the same way.
    model.forward = bound
    from accelerate.hooks import ModelHook
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(model.model.norm, ModelHook())
    with pytest.raises(KernelizeError, match=r"'model.norm' \(LlamaRMSNorm\).forward"):
        kernels_core.unkernelize(model)
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model.model.norm)
    kernels_core.unkernelize(model)
    assert kernels_core.get_report(model) is None


def test_two_models_kernelized_differently_including_rope(ref_pm, calls):
    from transformers.models.llama import modeling_llama

    original_global = modeling_llama.apply_rotary_pos_emb
    a, b = tiny_causal_lm("llama", seed=1), tiny_causal_lm("llama", seed=1)
    kernels_core.kernelize(a, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    kernels_core.kernelize(b, mode=Mode.INFERENCE, plugin_manager=ref_pm,
                           config={"kinds": {"rotary_embedding": {"enabled": False}, "rms_norm": {"enabled": False},
                                             "residual_rms_norm": {"enabled": False}}})
    ids = torch.randint(3, 100, (1, 6))
    calls.clear()
    with torch.no_grad():
        out_b = b(input_ids=ids).logits
    assert calls["rotary_embedding"] == 0 and calls["rms_norm"] == 0 and calls["residual_rms_norm"] == 0
    with torch.no_grad():
        out_a = a(input_ids=ids).logits
    assert calls["rotary_embedding"] == 2 and calls["rms_norm"] == 3 and calls["residual_rms_norm"] == 2
    assert modeling_llama.apply_rotary_pos_emb is original_global
    assert_close(out_a, out_b, what="same weights, different kernels")
    fresh = tiny_causal_lm("llama", seed=1)
    calls.clear()
    with torch.no_grad():
        fresh(input_ids=ids)
    assert sum(calls.values()) == 0, "a model built later must not inherit another model's kernels"


def test_deepcopy_save_load_keep_kernels_and_state(ref_installed, calls, tmp_path):
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_installed)
    ids = torch.randint(3, 100, (1, 6))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    for clone in (copy.deepcopy(model), _save_load(model)):
        calls.clear()
        with torch.no_grad():
            got = clone(input_ids=ids).logits
        assert torch.equal(got, expected)
        assert calls["rms_norm"] == 3 and calls["residual_rms_norm"] == 2 and calls["rotary_embedding"] == 2, \
            "the copy must stay kernelized"
        assert clone.model.norm.forward.__self__.module is clone.model.norm, "bound to the copy, not the original"
        kernels_core.unkernelize(clone)
        calls.clear()
        with torch.no_grad():
            assert_close(clone(input_ids=ids).logits, expected)
        assert sum(calls.values()) == 0


def _save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("mode", [Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE],
                         ids=["inference", "training"])
def test_torch_compile_fullgraph(ref_pm, mode):
    torch._dynamo.reset()
    model = tiny_causal_lm("qwen3")
    ids = torch.randint(3, 100, (2, 8))
    training = Mode.TRAINING in mode
    model.train(training)
    eager = model(input_ids=ids, labels=ids if training else None)
    kernels_core.kernelize(model, mode=mode, plugin_manager=ref_pm)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(input_ids=ids, labels=ids if training else None)
    if training:
        assert_close(out.loss, eager.loss)
        out.loss.backward()
        assert model.model.norm.weight.grad is not None
    else:
        assert_close(out.logits, eager.logits)


def test_disable_switch_is_a_reported_noop(pm, monkeypatch):
    monkeypatch.setenv("KERNELS_CORE_DISABLE", "1")
    model = tiny_causal_lm("llama")
    before = _snapshot(model)
    kernels_core.kernelize(model, plugin_manager=pm)
    report = kernels_core.get_report(model)
    assert report.disabled and "KERNELS_CORE_DISABLE=1" in report.disabled
    snapshot = _snapshot(model)
    snapshot[""].pop("_kernels_core_report")
    assert snapshot == before


def test_report_table_json_and_one_log_line(ref_pm, caplog):
    model = tiny_causal_lm("gemma2")
    with caplog.at_level(logging.DEBUG, logger="kernels_core"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and lines[0].getMessage().startswith("kernelize (TRAINING):")
    report = kernels_core.get_report(model)
    data = json.loads(report.to_json())
    applied = [e for e in data["entries"] if e["kernel"]]
    assert applied and all(e["plugin"] and e["device"] == "cpu" for e in applied)
    table = report.table()
    assert "model.layers.*.input_layernorm (x2)" in table and "ref.rms_norm" in table


def test_explicit_device_resolves_for_that_backend():
    spec = _rms("sim.rms_norm", "high_rms_norm", 100, backend="sim")
    backend = [BackendInfo("sim", "sim", (DeviceInfo(0, "simulated"),), priority=100)]
    pm = fresh_plugin_manager((_plugin("sim", [spec], backend), "sim"))
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, device="sim", plugin_manager=pm)
    assert _kernels(model) == {"sim.rms_norm"}
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=pm)
    assert _kernels(model) == {"any.rms_norm.recompute"}


@pytest.mark.parametrize("request_", ["rocm", "cuda", "cuda:1"])
def test_explicit_device_is_named_as_tensors_print_it(request_):
    # A ROCm backend drives torch's "cuda" devices: the report names the device, never the backend.
    spec = _rms("rocm.rms_norm", "high_rms_norm", 100, backend="rocm")
    backend = [BackendInfo("rocm", "cuda", (DeviceInfo(1, "simulated gfx942", arch="gfx942"),), priority=100)]
    pm = fresh_plugin_manager((_plugin("rocm", [spec], backend), "rocm"))
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, device=request_, plugin_manager=pm)
    devices = {e.device for e in kernels_core.get_report(model).entries}
    assert devices == {"cuda:1"}
    assert _kernels(model) == {"rocm.rms_norm"}
    with pytest.raises(KernelizeError, match=r"Detected: .*'rocm \(cuda:1\)'"):
        kernels_core.kernelize(tiny_causal_lm("llama"), device="npu", plugin_manager=pm)


def test_signature_of_bound_forward_is_the_original(ref_pm):
    import inspect

    model = tiny_causal_lm("llama")
    before = list(inspect.signature(model.forward).parameters)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert list(inspect.signature(model.forward).parameters) == before


def test_automatic_fallback_says_why_better_kernels_were_passed_over():
    needs_hopper = KernelSpec(id="sim.rms_norm.hopper", kind="rms_norm", variants=("standard",), backend="sim",
                              impl=f"{__name__}:high_rms_norm", priority=200,
                              capability=kernels_core.CapabilityRange(min=(9, 0)))
    broken = _rms("sim.rms_norm.broken", "does_not_exist", 150, backend="sim")
    fallback = _rms("sim.rms_norm.plain", "low_rms_norm", 100, backend="sim")
    backend = [BackendInfo("sim", "sim", (DeviceInfo(0, "simulated", capability=(8, 0)),), priority=100)]
    pm = fresh_plugin_manager((_plugin("sim", [needs_hopper, broken, fallback], backend), "sim"))
    with pytest.warns(kernels_core.KernelFallbackWarning, match="'sim.rms_norm.broken' of plugin 'sim'"):
        model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, device="sim", plugin_manager=pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.module == "model.norm")
    assert entry.kernel == "sim.rms_norm.plain"
    assert "sim.rms_norm.hopper: capability out of range: device is 8.0" in entry.note
    assert "sim.rms_norm.broken: failed to load" in entry.note
