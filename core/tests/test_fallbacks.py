"""Automatic fallbacks say so: once per kernel and process, in the report, in listings; strict turns them fatal."""

from __future__ import annotations

import json
import types
import warnings

import broken_plugins
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
from kernels_core._plugins._fallbacks import reset_fallbacks
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


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
    from kernels_core._plugins import _manager as manager_module

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


def match_raising(module, name, ctx):
    if isinstance(module, torch.nn.Linear):
        raise RuntimeError("matcher confused")
    return None


def test_a_matcher_raising_declines_naming_its_plugin():
    pm = _manager_with(LINEAR, kinds=[_kind(matcher=f"{__name__}:match_raising")])
    with pytest.warns(KernelFallbackWarning, match="matcher confused"):
        model = kernels_core.kernelize(_mixed_model(), mode=Mode.INFERENCE, plugin_manager=pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "scaled_linear")
    assert not entry.applied
    for part in (f"matcher {__name__}:match_raising", "plugin 'demo' (demo-plugin 1.0)",
                 "RuntimeError: matcher confused"):
        assert part in entry.reason, part


# -- third-party plugins with the usual mistakes (broken_plugins.py) ----------------------------------------------

def _broken_pm(*plugins):
    pm = fresh_plugin_manager()
    for plugin, name in plugins:
        pm.register(plugin, name, distribution=f"{name}-dist", version="0.1")
    return pm


def _linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.RMSNorm(8, eps=1e-6))


def test_a_raising_matcher_warns_once_for_its_kind_the_others_keep_binding_and_strict_raises():
    pm = _broken_pm((broken_plugins.Good(), "good"), (broken_plugins.MatcherRaises(), "sharp"))
    with pytest.warns(KernelFallbackWarning) as record:
        model = kernels_core.kernelize(_linears(), mode=Mode.INFERENCE, plugin_manager=pm)
    assert len(record) == 1, [str(r.message) for r in record]  # one per plugin and kind, not one per module
    message = str(record[0].message)
    for part in ("layer kind 'sharp_linear' of plugin 'sharp' (sharp-dist 0.1)", "broken_plugins:match_raising",
                 "RuntimeError: matcher confused by Linear", "module '0' (Linear) and 1 other module(s)",
                 "[kinds.sharp_linear] enabled = false", "KERNELS_CORE_DISABLE_PLUGINS=sharp"):
        assert part in message, part
    report = kernels_core.get_report(model)
    assert sorted(e.kernel for e in report.applied) == ["any.rms_norm.recompute", "good.linear", "good.linear"]
    # One row for the kind whose matcher raised, not one per module it raised on (none of them is matched).
    sharp = [e for e in report.entries if e.kind == "sharp_linear"]
    assert len(sharp) == 1 and sharp[0].module == "" and not sharp[0].applied
    assert "raised RuntimeError: matcher confused by Linear" in sharp[0].reason
    # Once per process and cause.
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        kernels_core.kernelize(_linears(), mode=Mode.INFERENCE, plugin_manager=pm)
    broken_plugins.assert_strict_refuses(_linears(), mode=Mode.INFERENCE, plugin_manager=pm,
                                         match=r"strict kernelize: 1 piece\(s\) of broken plugin code: layer kind "
                                               r"'sharp_linear' of plugin 'sharp'.*matcher confused")


def test_an_adapter_raising_for_one_kernel_falls_back_to_the_next_best_with_one_warning():
    pm = _broken_pm((broken_plugins.AdapterRaises(), "flat"))
    eager = _linears()
    with pytest.warns(KernelFallbackWarning) as record:
        model = kernels_core.kernelize(_linears(), mode=Mode.INFERENCE, plugin_manager=pm)
    assert len(record) == 1, [str(r.message) for r in record]
    message = str(record[0].message)
    for part in ("layer kind 'flat_linear' of plugin 'flat' (flat-dist 0.1)", "adapter broken_plugins:adapt_raising",
                 "TypeError: adapter cannot build around linear_no_bias", "kernel 'flat.linear.nobias'",
                 "module '0' (Linear) and 1 other module(s)", "the next candidate kernel runs there"):
        assert part in message, part
    report = kernels_core.get_report(model)
    linears = [e for e in report.entries if e.kind == "flat_linear"]
    assert [e.kernel for e in linears] == ["flat.linear", "flat.linear"]
    assert all("flat.linear.nobias: the adapter broken_plugins:adapt_raising of plugin 'flat' raised TypeError"
               in e.note for e in linears)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), eager(x))


def test_an_adapter_raising_for_every_kernel_leaves_its_modules_alone_and_strict_raises():
    pm = _broken_pm((broken_plugins.AdapterAlwaysRaises(), "flat"))
    with pytest.warns(KernelFallbackWarning, match="adapter broken_plugins:adapt_always_raising raised RuntimeError"):
        model = kernels_core.kernelize(_linears(), mode=Mode.INFERENCE, plugin_manager=pm)
    report = kernels_core.get_report(model)
    assert [e.kernel for e in report.applied] == ["any.rms_norm.recompute"]
    linears = [e for e in report.entries if e.kind == "flat_linear"]
    assert len(linears) == 2 and all("adapter broken_plugins:adapt_always_raising of plugin 'flat' raised "
                                     "RuntimeError: adapter always fails" in e.reason for e in linears)
    assert all("forward" not in model[i].__dict__ for i in (0, 1))
    broken_plugins.assert_strict_refuses(_linears(), mode=Mode.INFERENCE, plugin_manager=pm,
                                         match=r"broken plugin code: layer kind 'flat_linear' of plugin 'flat'")


def test_a_failure_outside_any_kernel_names_the_kernels_bound_inside_nearest_first():
    # wide.linear returns one column too many from each MLP's down_proj; the decoder layer's residual add raises,
    # inside the base model, whose forward runs with the causal-mask kernel.
    pm = _broken_pm((broken_plugins.WideDownProj(), "wide"))
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=pm)
    applied = {e.module: e.kernel for e in kernels_core.get_report(model).applied}
    assert applied["model.layers.0.mlp.down_proj"] == "wide.linear"
    assert applied["model"] == "any.causal_mask.sdpa_is_causal"
    with pytest.raises(RuntimeError) as info:
        model(input_ids=torch.randint(3, 100, (2, 7)))
    (note,) = [n for n in info.value.__notes__ if n.startswith("kernels-core:")]
    assert note.startswith("kernels-core: raised outside any kernel, in the code of module 'model.layers.0'")
    assert "'wide.linear' (plugin 'wide') on 'model.layers.0.mlp.down_proj' and 1 other module(s)" in note
    listed = note[note.index("nearest first:"):note.index("; to run without")]
    # Kernels bound in the layer that raised come before the model's own, which the original note blamed alone.
    assert listed.index("'wide.linear'") < listed.index("'any.causal_mask.sdpa_is_causal'")
    disable = note[note.index("kernels.disable = ["):]
    assert '"wide.linear"' in disable and '"any.causal_mask.sdpa_is_causal"' in disable


def test_a_kernel_raising_under_torch_compile_shows_its_own_exception():
    pm = _broken_pm((broken_plugins.KernelRaises(), "raising"))
    model = kernels_core.kernelize(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                                   mode=Mode.INFERENCE | Mode.TORCH_COMPILE, plugin_manager=pm)
    assert kernels_core.get_report(model).applied[0].kernel == "raising.linear"
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as info:  # noqa: B017 - Dynamo's exception type varies between versions
            compiled(torch.randn(2, 8))
    finally:
        torch._dynamo.reset()
    chain, exc = [], info.value
    while exc is not None:
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(chain)
    assert "linear kernel exploded" in text and "hasattr" not in text, text


# -- a matcher that raises on modules other than its target (mistaken_plugins.CarelessMatcher) ------------------------

def test_a_raising_matcher_is_one_report_row_with_its_traceback_kept(caplog):
    import logging
    import warnings

    import mistaken_plugins
    from kernels_core.testing import tiny_causal_lm

    pm = fresh_plugin_manager((mistaken_plugins.CarelessMatcher(), "acme"))
    model = tiny_causal_lm("llama")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="kernels_core"):
        warnings.simplefilter("always")
        kernels_core.kernelize(model, plugin_manager=pm, mode=kernels_core.Mode.INFERENCE)
    report = kernels_core.get_report(model)
    rows = [e for e in report.entries if e.kind == "fc_mlp"]
    assert len(rows) == 1 and rows[0].module == "" and "match_fc_mlp raised AttributeError" in rows[0].reason
    assert f"of {len(report.entries) - 1} matched modules" in report.summary()
    # Public names only: the warning is the user's (this file), its class kernels_core's.
    (warning,) = [w for w in caught if "fc_mlp" in str(w.message)]
    assert warning.filename == __file__ and warning.category.__module__ == "kernels_core"
    assert any(r.exc_info and r.name == "kernels_core" and "fc_mlp" in r.getMessage() for r in caplog.records)
    with pytest.raises(kernels_core.KernelizeError) as raised:
        kernels_core.kernelize(tiny_causal_lm("llama"), plugin_manager=pm, strict=True,
                               mode=kernels_core.Mode.INFERENCE)
    assert isinstance(raised.value.__cause__, AttributeError)
    assert type(raised.value).__module__ == "kernels_core" and kernels_core.PluginError.__module__ == "kernels_core"
