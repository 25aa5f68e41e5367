"""Automatic fallbacks say so: once per kernel and process, in the report, in listings; strict turns them fatal."""

from __future__ import annotations

import json
import types
import warnings

import kernels_core
import pytest
import torch
from kernels_core import KernelFallbackWarning
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import LayerKind
from kernels_core import Match
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core._plugin_info import reset_fallbacks
from kernels_core.testing import fresh_plugin_manager


def _plugin(**hooks):
    module = types.ModuleType("demo_inline")
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def _norm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6))


MISSING = KernelSpec(id="demo.rms_norm.missing", kind="rms_norm", variants=("standard", "offset"), backend="any",
                     impl="demo_no_such_module:rms_norm", priority=100, supports=Supports.BACKWARD)


def _manager_with(*specs, kinds=()):
    pm = fresh_plugin_manager()
    pm.register(_plugin(kernels_core_kernels=lambda: list(specs), kernels_core_layer_kinds=lambda: list(kinds)),
                "demo", distribution="demo-plugin", version="1.0")
    return pm


def test_missing_impl_warns_once_naming_plugin_kernel_and_cause_and_is_reported(capsys):
    pm = _manager_with(MISSING)
    with pytest.warns(KernelFallbackWarning) as record:
        model = kernels_core.kernelize(_norm_model(), mode=Mode.INFERENCE, plugin_manager=pm)
    assert len(record) == 1
    message = str(record[0].message)
    for part in ("'demo.rms_norm.missing'", "plugin 'demo'", "demo-plugin 1.0",
                 "No module named 'demo_no_such_module'", 'kernels.disable = ["demo.rms_norm.missing"]'):
        assert part in message, part
    entry = kernels_core.get_report(model).applied[0]
    assert entry.kernel == "any.rms_norm.recompute"
    assert "demo.rms_norm.missing: failed to load" in entry.note
    # Once per kernel and process: kernelizing again falls back silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        kernels_core.kernelize(_norm_model(), mode=Mode.INFERENCE, plugin_manager=pm)
    # The listing shows it too, in this process ...
    assert [s for s, _ in pm.kernel_problems()["demo.rms_norm.missing"]] == ["fell back"]
    from kernels_core import _cli
    from kernels_core import _manager as manager_module

    previous = manager_module.reset_plugin_manager(pm)
    try:
        assert _cli.main(["kernels"]) == 0
        out = capsys.readouterr().out
        assert "fell back: demo.rms_norm.missing (demo): passed over in this process" in out
        # ... and in a process that never kernelized: the impl module is looked for without importing anything.
        reset_fallbacks()
        assert _cli.main(["kernels", "--json"]) == 0
        data = {k["id"]: k for k in json.loads(capsys.readouterr().out)["kernels"]}
        problems = data["demo.rms_norm.missing"]["problems"]
        assert problems[0]["status"] == "impl missing"
        assert "module 'demo_no_such_module' not found" in problems[0]["detail"]
        assert data["any.rms_norm.recompute"]["problems"] == []
    finally:
        manager_module.reset_plugin_manager(previous)


# A plugin layer kind over nn.Linear, for the broken-kind cases.
def match_linear(module, name, ctx):
    return Match("scaled_linear", "plain") if isinstance(module, torch.nn.Linear) else None


def adapt_linear(module, match, impl, options):
    return lambda x: impl(x, module.weight, module.bias)


def scaled_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


def _kind(matcher=f"{__name__}:match_linear", adapter=f"{__name__}:adapt_linear"):
    return LayerKind(name="scaled_linear", description="linear", variants=("plain",), matcher=matcher, adapter=adapter)


LINEAR = KernelSpec(id="demo.scaled_linear.k", kind="scaled_linear", variants=("plain",), backend="any",
                    impl=f"{__name__}:scaled_linear", supports=Supports.BACKWARD)


def _mixed_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8, eps=1e-6))


@pytest.mark.parametrize("role", ["adapter", "matcher"])
def test_plugin_kind_with_a_broken_ref_is_declined_and_other_kinds_keep_binding(role):
    kind = _kind(**{role: "demo_nowhere:" + role})
    pm = _manager_with(LINEAR, kinds=[kind])
    with pytest.warns(KernelFallbackWarning, match=f"layer kind 'scaled_linear' of plugin 'demo' \\(demo-plugin 1.0\\)"
                                                   f" is not used.*its {role} 'demo_nowhere:{role}' cannot be loaded"):
        model = kernels_core.kernelize(_mixed_model(), mode=Mode.INFERENCE, plugin_manager=pm)
    report = kernels_core.get_report(model)
    assert [e.kernel for e in report.applied] == ["any.rms_norm.recompute"]
    declined = [e for e in report.entries if e.kind == "scaled_linear"]
    assert len(declined) == 1 and not declined[0].applied
    assert f"{role} 'demo_nowhere:{role}'" in declined[0].reason and "No module named" in declined[0].reason
    assert "forward" not in model[0].__dict__


def test_broken_plugin_kind_makes_strict_kernelize_raise_and_leaves_the_model_alone():
    pm = _manager_with(LINEAR, kinds=[_kind(adapter="demo_nowhere:adapt")])
    model = _mixed_model()
    with pytest.warns(KernelFallbackWarning), pytest.raises(KernelizeError, match="scaled_linear.*demo_nowhere:adapt"):
        kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm, strict=True)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert kernels_core.get_report(model) is None


def test_working_plugin_kind_binds():
    pm = _manager_with(LINEAR, kinds=[_kind()])
    model = kernels_core.kernelize(_mixed_model(), mode=Mode.INFERENCE, plugin_manager=pm, strict=True)
    assert sorted(e.kernel for e in kernels_core.get_report(model).applied) == ["any.rms_norm.recompute",
                                                                                "demo.scaled_linear.k"]


def broken_linear(x, weight, bias):
    raise ValueError("kernel went wrong")


def test_a_kernel_raising_at_run_time_keeps_its_type_and_names_kernel_plugin_module_and_switch():
    spec = KernelSpec(id="demo.scaled_linear.broken", kind="scaled_linear", variants=("plain",), backend="any",
                      impl=f"{__name__}:broken_linear", supports=Supports.BACKWARD)
    pm = _manager_with(spec, kinds=[_kind()])
    model = kernels_core.kernelize(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8))),
                                   mode=Mode.INFERENCE, plugin_manager=pm)
    with pytest.raises(ValueError, match="kernel went wrong") as info:
        model(torch.randn(2, 8))
    notes = [n for n in info.value.__notes__ if n.startswith("kernels-core:")]
    assert len(notes) == 1
    for part in ("'demo.scaled_linear.broken'", "plugin 'demo' (demo-plugin 1.0)", "module '0.0' (Linear)",
                 'kernels.disable = ["demo.scaled_linear.broken"]', "unkernelize"):
        assert part in notes[0], part


def adapt_raising(module, match, impl, options):
    raise RuntimeError("adapter cannot build")


def match_raising(module, name, ctx):
    if isinstance(module, torch.nn.Linear):
        raise RuntimeError("matcher confused")
    return None


def test_an_adapter_raising_at_bind_time_is_a_kernelize_error_naming_everything_and_changes_nothing():
    pm = _manager_with(LINEAR, kinds=[_kind(adapter=f"{__name__}:adapt_raising")])
    model = _mixed_model()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(KernelizeError) as info:
        kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    message = str(info.value)
    for part in ("module '0' (Linear)", "kernel 'demo.scaled_linear.k'", "plugin 'demo'",
                 "distribution demo-plugin", "kind 'scaled_linear'", f"{__name__}:adapt_raising",
                 "RuntimeError: adapter cannot build", 'kernels.disable = ["demo.scaled_linear.k"]'):
        assert part in message, part
    assert isinstance(info.value.__cause__, RuntimeError)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    assert kernels_core.get_report(model) is None


def test_a_matcher_raising_declines_naming_its_plugin():
    pm = _manager_with(LINEAR, kinds=[_kind(matcher=f"{__name__}:match_raising")])
    model = kernels_core.kernelize(_mixed_model(), mode=Mode.INFERENCE, plugin_manager=pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "scaled_linear")
    assert not entry.applied
    for part in (f"matcher {__name__}:match_raising", "plugin 'demo'", "distribution demo-plugin",
                 "RuntimeError: matcher confused"):
        assert part in entry.reason, part
