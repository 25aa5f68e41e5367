"""``kernels-core check``: each kernel against its kind's conformance cases, and the pytest helper."""

from __future__ import annotations

import json

import broken_plugins
import conformance_plugins
import pytest
from kernels_core import _cli
from kernels_core._check import check
from kernels_core._errors import CheckError
from kernels_core._plugins import _manager
from kernels_core.testing import assert_conforms
from kernels_core.testing import fresh_plugin_manager


@pytest.fixture
def wrong_pm():
    return fresh_plugin_manager((conformance_plugins.Wrong(), "wrong"), (conformance_plugins.Elsewhere(), "elsewhere"))


def _rows(report, kernel):
    return [r for r in report.results if r.kernel == kernel]


def test_portable_rms_norm_passes_every_dtype_and_variant_and_compiles(pm):
    report = check(["portable"], kernels=["any.rms_norm.recompute"], plugin_manager=pm)
    rows = _rows(report, "any.rms_norm.recompute")
    eager = {(r.dtype, r.case) for r in rows if "compiled" not in r.case}
    assert eager == {(d, c) for d in ("float32", "bfloat16", "float16")
                     for c in ("standard: LlamaRMSNorm(37)", "offset: GemmaRMSNorm(37)")}
    assert sum("compiled, aot_eager" in r.case for r in rows) == 2
    assert all(r.status == "pass" and r.device == "cpu" and r.error is not None for r in rows)
    assert report.ok


def test_a_kernel_off_by_a_factor_fails_with_its_error_and_bound(wrong_pm):
    report = check(["wrong"], kernels=["bad.rms_norm.scaled"], plugin_manager=wrong_pm)
    (row,) = _rows(report, "bad.rms_norm.scaled")
    assert row.status == "fail" and row.error > 0.3 and row.bound == pytest.approx(2e-5)
    assert row.result_text().startswith("FAIL max err") and "(bound 2.0e-05)" in row.result_text()
    assert not report.ok


def test_a_wrong_backward_fails_naming_the_gradient(wrong_pm):
    (row,) = _rows(check(["wrong"], kernels=["bad.silu.backward"], plugin_manager=wrong_pm), "bad.silu.backward")
    assert row.status == "fail" and "grad of" in row.reason


def test_a_wrong_output_dtype_fails(wrong_pm):
    rows = _rows(check(["wrong"], kernels=["bad.rms_norm.dtype"], plugin_manager=wrong_pm), "bad.rms_norm.dtype")
    (row,) = rows
    assert row.status == "fail" and "dtype torch.float32, the module gives torch.bfloat16" in row.reason


def test_a_false_compile_declaration_fails_only_the_compiled_run(wrong_pm):
    rows = _rows(check(["wrong"], kernels=["bad.silu.compile"], plugin_manager=wrong_pm), "bad.silu.compile")
    assert [(("compiled" in r.case), r.status) for r in rows] == [(False, "pass"), (True, "fail")]
    assert "the kernel raised" in rows[1].reason


def test_an_impl_that_does_not_import_fails(wrong_pm):
    (row,) = _rows(check(["wrong"], kernels=["bad.silu.missing"], plugin_manager=wrong_pm), "bad.silu.missing")
    assert row.status == "fail" and row.reason.startswith("impl missing: impl 'conformance_plugins:does_not_exist'")


def test_what_cannot_be_checked_here_is_skipped_with_the_reason(wrong_pm):
    report = check(["elsewhere"], plugin_manager=wrong_pm)
    by_kernel = {r.kernel: r for r in report.results if r.status != "pass"}
    assert by_kernel["acme.silu.fast"].reason == "no acme device detected"
    assert by_kernel["ok.opaque"].reason == "kind declares no conformance test"
    assert by_kernel["ok.broken_cases"].status == "fail"
    assert "RuntimeError: cases need a GPU" in by_kernel["ok.broken_cases"].reason
    # Inference-only: forward in eval under no_grad, both variants.
    assert [r.status for r in _rows(report, "ok.silu.inference")] == ["pass", "pass"]


def test_unknown_plugin_or_kernel_names_the_closest(wrong_pm):
    with pytest.raises(CheckError, match=r"unknown plugin 'portabel' \(did you mean 'portable'\?\)"):
        check(["portabel"], plugin_manager=wrong_pm)
    with pytest.raises(CheckError, match=r"did you mean 'bad.silu.compile'"):
        check(["wrong"], kernels=["bad.silu.compiel"], plugin_manager=wrong_pm)


def test_a_plugin_that_failed_to_load_is_a_failure():
    pm = fresh_plugin_manager()
    pm.strict = False
    pm.register(object(), "hollow")  # loads, declares nothing
    report = check(["hollow"], plugin_manager=pm)
    assert [(r.plugin, r.status, r.reason) for r in report.results] == [
        ("hollow", "skipped", "the plugin declares no kernels")]


@pytest.fixture
def installed(wrong_pm):
    previous = _manager.reset_plugin_manager(wrong_pm)
    yield
    _manager.reset_plugin_manager(previous)


def test_cli_exit_status_and_table(installed, capsys):
    assert _cli.main(["check", "wrong", "--kernel", "bad.rms_norm.scaled", "--no-compile"]) == 1
    out = capsys.readouterr().out
    assert "bad.rms_norm.scaled" in out and "FAIL max err" in out and "1 failed" in out
    assert _cli.main(["check", "portable", "--kernel", "any.silu_gated_mlp.recompute", "--no-compile",
                      "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["compile_backend"] is None and len(data["results"]) == 6
    assert _cli.main(["check", "portabel"]) == 2
    assert "did you mean 'portable'" in capsys.readouterr().err


def test_assert_conforms_is_the_same_check(wrong_pm):
    report = assert_conforms("portable", kernel="any.silu_gated_mlp.recompute", plugin_manager=wrong_pm,
                             compile=False)
    assert report.ok and len(report.results) == 6
    with pytest.raises(AssertionError, match=r"bad.rms_norm.scaled .* FAIL max err"):
        assert_conforms("wrong", kernel="bad.rms_norm.scaled", plugin_manager=wrong_pm)


# -- broken third-party plugins (broken_plugins.py): failed rows, and the check goes on -------------------------------

@pytest.fixture
def broken_pm():
    return fresh_plugin_manager((broken_plugins.Good(), "good"), (broken_plugins.MatcherRaises(), "sharp"),
                                (broken_plugins.AdapterAlwaysRaises(), "flat"))


def test_a_raising_matcher_or_adapter_fails_its_rows_and_the_check_goes_on(broken_pm):
    report = check(["sharp", "flat", "good"], plugin_manager=broken_pm, compile=False)
    # The matcher raises on every Linear: on the case's module and on the real models' (the model zoo row).
    zoo, sharp = sorted(_rows(report, "sharp.linear"), key=lambda r: r.case != "model zoo")
    assert zoo.case == "model zoo" and zoo.status == "fail" and "raised on 1 module class(es)" in zoo.reason
    assert sharp.status == "fail" and sharp.reason == (
        "the kind's matcher broken_plugins:match_raising (plugin 'sharp') raised RuntimeError: matcher confused by "
        "Linear")
    (flat,) = _rows(report, "flat.linear.nobias")
    assert flat.status == "fail" and flat.reason == (
        "the kind's adapter broken_plugins:adapt_always_raising (plugin 'flat') raised RuntimeError: adapter always "
        "fails")
    assert [r.status for r in _rows(report, "good.linear")] == ["pass"]
    with pytest.raises(AssertionError, match=r"3 failed(.|\n)*sharp.linear(.|\n)*matcher confused"):
        assert_conforms("sharp", "flat", "good", plugin_manager=broken_pm, compile=False)


def test_the_command_reports_broken_plugins_as_failed_rows(broken_pm, capsys):
    previous = _manager.reset_plugin_manager(broken_pm)
    try:
        assert _cli.main(["check", "sharp", "flat", "good", "--no-compile"]) == 1
    finally:
        _manager.reset_plugin_manager(previous)
    out = capsys.readouterr().out
    assert "FAIL: the kind's matcher broken_plugins:match_raising" in out
    assert "FAIL: the kind's adapter broken_plugins:adapt_always_raising" in out
    assert "3 kernel(s) checked: 1 passed, 3 failed" in out  # sharp fails its case and the model zoo


def test_under_compile_the_kernel_own_exception_is_reported():
    pm = fresh_plugin_manager((broken_plugins.KernelRaises(), "raising"))
    rows = _rows(check(["raising"], plugin_manager=pm), "raising.linear")
    assert [("compiled" in r.case, r.status) for r in rows] == [(False, "fail"), (True, "fail")]
    assert rows[0].reason == "the kernel raised ValueError: linear kernel exploded"
    assert rows[1].reason.startswith("the kernel raised ValueError: linear kernel exploded (eagerly too; under "
                                     "torch.compile: ")
    assert "hasattr" not in rows[1].reason


# -- what a third-party author gets wrong (mistaken_plugins.py): check finds what a real model finds -----------------

def _acme(plugin):
    import mistaken_plugins

    pm = fresh_plugin_manager((getattr(mistaken_plugins, plugin)(), "acme"))
    pm.strict = False
    pm.invalidate()
    return pm


def test_a_matcher_that_raises_on_other_modules_fails_over_the_model_zoo():
    report = check(["acme"], plugin_manager=_acme("CarelessMatcher"), compile=False)
    (zoo,) = [r for r in report.results if r.case == "model zoo"]
    assert zoo.status == "fail" and "mistaken_plugins:match_fc_mlp (plugin 'acme') raised on" in zoo.reason
    assert "LlamaRMSNorm" in zoo.reason or "more" in zoo.reason
    assert "AttributeError" in zoo.reason and not report.ok
    assert check(["acme"], plugin_manager=_acme("CarefulMatcher"), compile=False).ok


def test_a_norm_that_forgets_eps_fails_on_the_edge_rows():
    report = check(["acme"], plugin_manager=_acme("NoEps"), compile=False)
    rows = _rows(report, "acme.rms_norm.no_eps")
    assert rows and all(r.status == "fail" for r in rows)
    assert {r.dtype for r in rows} == {"float32", "bfloat16", "float16"}
    assert check(["acme"], plugin_manager=_acme("Ok"), compile=False).ok


def test_a_one_percent_error_fails_in_every_dtype():
    rows = _rows(check(["acme"], plugin_manager=_acme("Scaled"), compile=False), "acme.rms_norm.scaled")
    assert {r.dtype for r in rows if r.status == "fail"} == {"float32", "bfloat16", "float16"}
    assert all(r.status == "fail" for r in rows)


def test_a_rejected_kernel_fails_the_check_and_assert_conforms(capsys):
    pm = _acme("MisspeltVariant")
    report = check(["acme"], plugin_manager=pm, compile=False)
    (row,) = report.results
    assert row.kernel == "acme.rms_norm.ofset" and row.status == "fail"
    assert row.reason.startswith("rejected: ") and "'ofset' -> 'offset'?" in row.reason
    with pytest.raises(AssertionError, match="acme.rms_norm.ofset"):
        assert_conforms("acme", plugin_manager=pm, compile=False)
    previous = _manager.reset_plugin_manager(pm)
    try:
        assert _cli.main(["check", "acme", "--no-compile"]) == 1
    finally:
        _manager.reset_plugin_manager(previous)


def test_a_misspelt_field_or_api_attribute_fails_the_check():
    report = check(["acme"], plugin_manager=_acme("MisspeltField"), compile=False)
    assert [r.reason for r in report.results if r.kernel == "acme.rms_norm.typo"] == [
        "rejected: kernel 'acme.rms_norm.typo': KernelSpec has no field 'prority' (did you mean 'priority'?). Fix "
        "the KernelSpec in kernels_core_kernels()"]
    assert not report.ok
    report = check(["acme"], plugin_manager=_acme("MisspeltApi"), compile=False)
    assert not report.ok and any("KERNELS_CORE_PLUGIN_APl" in (r.reason or "") for r in report.failures)


def test_the_plugin_losing_a_kernel_id_fails_its_check():
    import mistaken_plugins

    pm = fresh_plugin_manager((mistaken_plugins.Ok(), "acme"), (mistaken_plugins.IdThief(), "zeta"))
    pm.strict = False
    pm.invalidate()
    report = check(["acme"], plugin_manager=pm, compile=False)
    (row,) = report.results
    assert row.status == "fail" and "'zeta''s (the highest priority) is used instead of this one" in row.reason


def test_kernels_and_check_share_the_impl_missing_verdict(capsys):
    pm = _acme("MissingImpl")
    previous = _manager.reset_plugin_manager(pm)
    try:
        assert _cli.main(["kernels"]) == 0
        out = capsys.readouterr().out
        assert _cli.main(["check", "acme", "--no-compile"]) == 1
        checked = capsys.readouterr().out
    finally:
        _manager.reset_plugin_manager(previous)
    (line,) = [line for line in out.splitlines() if line.startswith("acme.rms_norm.missing")]
    assert line.rstrip().endswith("impl missing")
    assert "impl missing: impl 'mistaken_plugins:no_such_function'" in checked


def test_plugin_exceptions_keep_their_traceback_in_check_json_and_traceback(broken_pm, capsys):
    previous = _manager.reset_plugin_manager(broken_pm)
    try:
        assert _cli.main(["check", "sharp", "--no-compile", "--json"]) == 1
        data = json.loads(capsys.readouterr().out)
        assert _cli.main(["check", "sharp", "--no-compile", "--traceback"]) == 1
        out = capsys.readouterr().out
    finally:
        _manager.reset_plugin_manager(previous)
    (row,) = [r for r in data["results"] if r["kernel"] == "sharp.linear" and r["case"] != "model zoo"]
    assert row["traceback"].startswith("Traceback (most recent call last)")
    assert 'raise RuntimeError(f"matcher confused by' in row["traceback"]
    assert "Traceback (most recent call last)" in out and 'raise RuntimeError(f"matcher confused by' in out
