"""Plugin discovery from installed distributions, fault isolation, allow/block lists, conflicts."""

from __future__ import annotations

import logging
import sys
import textwrap
import types

import pytest
from kernels_core import BackendInfo
from kernels_core import KernelSpec
from kernels_core import KernelsPluginManager
from kernels_core import Mode
from kernels_core import PluginError
from kernels_core import PluginStatus
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import fresh_plugin_manager


def _install_distribution(root, dist_name, version, module_name, source, entry_name):
    """Write a real (unpacked, wheel-style) distribution onto a sys.path entry: metadata plus module."""
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kernels_core.plugins]\n{entry_name} = {module_name}\n")


GOOD = """
from kernels_core import KernelSpec, hookimpl

@hookimpl
def kernels_core_kernels():
    return [KernelSpec(id="demo.rms_norm.x", kind="rms_norm", variants=("standard",), backend="cpu",
                       impl="demo_good:rms_norm", priority=5)]

def rms_norm(x, weight, *, eps, offset, casting):
    raise AssertionError("listing must not call kernels")
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.startswith("demo_")]:
        del sys.modules[name]


def _manager(**kwargs):
    # Only the plugins a test installs (plus the core's own), whatever else the venv holds.
    kwargs.setdefault("allow", ["portable", "demo", "broken", "raising", "malformed", "typo", "dup"])
    return KernelsPluginManager(**kwargs)


def test_entry_point_discovery_from_installed_distribution(site):
    _install_distribution(site, "demo-plugin", "1.2.3", "demo_good", GOOD, "demo")
    pm = _manager()
    info = {p.name: p for p in pm.plugins}
    assert info["demo"].status == "loaded"
    assert (info["demo"].distribution, info["demo"].version) == ("demo-plugin", "1.2.3")
    assert info["builtin"].distribution == "kernels-core"
    ids = [p.spec.id for p in pm.kernels()]
    assert "demo.rms_norm.x" in ids
    assert "demo_good" in sys.modules  # imported to read hooks, but its kernel was never called


def test_import_failure_is_isolated_with_one_warning(site, caplog):
    _install_distribution(site, "demo-plugin", "1.0", "demo_good", GOOD, "demo")
    _install_distribution(site, "broken-plugin", "0.1", "demo_broken", "raise ImportError('libfoo.so missing')",
                          "broken")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        pm = _manager()
    info = {p.name: p for p in pm.plugins}
    assert info["broken"].status == "failed"
    assert "libfoo.so missing" in info["broken"].reason
    assert info["demo"].status == "loaded"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'broken'" in warnings[0] and "broken-plugin 0.1" in warnings[0]


def test_strict_switch_makes_failures_raise(site, monkeypatch):
    _install_distribution(site, "broken-plugin", "0.1", "demo_broken", "raise RuntimeError('two accelerators')",
                          "broken")
    monkeypatch.setenv("KERNELS_CORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="broken-plugin 0.1.*two accelerators"):
        _manager()


def _plugin(**hooks):
    module = types.ModuleType("demo_inline")
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def test_raising_hook_skips_only_that_plugin(caplog):
    def kernels_core_detect_devices():
        raise RuntimeError("driver exploded")

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    from kernels_core import _builtin

    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_detect_devices=kernels_core_detect_devices), "raising", distribution="r",
                version="9")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        backends = [b.backend for b, _ in pm.backends()]
    assert backends == ["cpu"]
    assert pm.info("raising").status == "skipped"
    assert "driver exploded" in pm.info("raising").reason
    assert sum("r 9" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ["not a spec"],
        lambda: [KernelSpec(id="x.y", kind="no_such_kind", variants=("a",), backend="cpu", impl="m:f")],
    ],
    ids=["wrong-type", "unknown-kind"],
)
def test_malformed_specs_skip_the_plugin(bad):
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_kernels=bad), "malformed")
    assert pm.kernels() == []
    assert pm.info("malformed").status == "skipped"


def test_invalid_spec_construction_fails_in_the_plugin():
    with pytest.raises(ValueError, match="dtypes"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f", dtypes=("int8",))
    with pytest.raises(ValueError, match="lazy reference"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="cpu", impl="not a ref")
    with pytest.raises(ValueError, match="PEP 508"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f", requires=("!!",))
    compiled = Supports.BACKWARD | Supports.TORCH_COMPILE
    for mode in (Mode.INFERENCE, Mode.TORCH_COMPILE, "INFERENCE|TORCH_COMPILE"):
        with pytest.raises(ValueError, match="native_when_compiled must be a Mode combining TORCH_COMPILE"):
            KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f",
                       supports=compiled, native_when_compiled=mode)
    with pytest.raises(ValueError, match="needs Supports.TORCH_COMPILE"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f",
                   native_when_compiled=Mode.INFERENCE | Mode.TORCH_COMPILE)
    with pytest.raises(ValueError, match="reserved"):
        BackendInfo(backend="any", device_type="cpu")


def test_misspelled_hook_is_reported():
    def kernels_core_kernals():  # typo on purpose
        return []

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_plugin(kernels_core_kernals=kernels_core_kernals), "typo")
    assert pm.info("typo").status == "failed"
    assert "kernels_core_kernals" in pm.info("typo").reason and "misspelled" in pm.info("typo").reason


def test_block_and_allow_lists_from_environment(site, monkeypatch):
    _install_distribution(site, "demo-plugin", "1.0", "demo_good", GOOD, "demo")
    monkeypatch.setenv("KERNELS_CORE_DISABLE_PLUGINS", "demo")
    pm = KernelsPluginManager()
    assert pm.info("demo").status == "blocked"
    assert "demo_good" not in sys.modules, "a blocked plugin must not even be imported"
    monkeypatch.delenv("KERNELS_CORE_DISABLE_PLUGINS")
    monkeypatch.setenv("KERNELS_CORE_PLUGINS", "portable")
    pm = KernelsPluginManager()
    assert pm.info("demo").status == "blocked" and "allow-list" in pm.info("demo").reason
    assert pm.info("builtin").status == "loaded", "the built-in plugin cannot be blocked"


def _spec(kernel_id, priority, kind="rms_norm"):
    return KernelSpec(id=kernel_id, kind=kind, variants=("standard",), backend="cpu", impl="m:f", priority=priority)


def test_duplicate_ids_and_equal_priorities_are_reported(caplog):
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_kernels=lambda: [_spec("dup.k", 7)]), "alpha")
    pm.register(_plugin(kernels_core_kernels=lambda: [_spec("dup.k", 3), _spec("beta.k", 7)]), "beta")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        kernels = pm.kernels()
    assert [(k.spec.id, k.plugin.name) for k in kernels] == [("beta.k", "beta"), ("dup.k", "alpha")] or \
        [(k.spec.id, k.plugin.name) for k in kernels] == [("dup.k", "alpha"), ("beta.k", "beta")]
    assert any("kernel id 'dup.k' is declared by plugins 'alpha' (priority 7), 'beta' (priority 3); 'alpha''s"
               in c for c in pm.conflicts)
    assert any("both declare priority 7" in c for c in pm.conflicts)


def test_order_never_depends_on_registration_order():
    from kernels_core import _builtin

    def build(order):
        pm = KernelsPluginManager(load_entrypoints=False, strict=False)
        pm.register(_builtin, "builtin")
        plugins = {"zeta": [_spec("zeta.k", 10)], "alpha": [_spec("alpha.k", 10)], "mid": [_spec("mid.k", 20)]}
        for name in order:
            pm.register(_plugin(kernels_core_kernels=lambda v=plugins[name]: v), name)
        return [k.spec.id for k in pm.kernels()]

    assert build(["zeta", "alpha", "mid"]) == build(["mid", "alpha", "zeta"]) == ["mid.k", "alpha.k", "zeta.k"]


def test_layer_kind_clash_skips_the_later_plugin(caplog):
    from kernels_core import LayerKind
    from kernels_core import _builtin

    def kinds():
        return [LayerKind(name="attention", description="x", variants=("causal",), matcher="m:f", adapter="m:g")]

    def rms_kind():
        return [LayerKind(name="rms_norm", description="x", variants=("standard",), matcher="m:f", adapter="m:g")]

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_layer_kinds=kinds), "alpha")
    pm.register(_plugin(kernels_core_layer_kinds=kinds), "beta")
    pm.register(_plugin(kernels_core_layer_kinds=rms_kind), "aaa")
    assert pm.layer_kinds()["attention"].plugin.name == "alpha"
    assert pm.layer_kinds()["rms_norm"].plugin.name == "builtin", "the core's own kinds always win"
    assert pm.info("beta").status == "skipped" and "already declared by plugin 'alpha'" in pm.info("beta").reason
    assert pm.info("aaa").status == "skipped"


def test_backend_reason_reaches_explicit_device_errors():
    import kernels_core
    from kernels_core import KernelizeError
    from kernels_core.testing import fresh_plugin_manager

    torch = pytest.importorskip("torch")
    absent = [BackendInfo(backend="npu", device_type="npu", reason="torch_npu failed: libhccl.so missing")]
    pm = fresh_plugin_manager((_plugin(kernels_core_detect_devices=lambda: absent), "npu"))
    with pytest.raises(KernelizeError, match="npu: torch_npu failed: libhccl.so missing"):
        kernels_core.kernelize(torch.nn.Sequential(torch.nn.LayerNorm(4)), device="npu", plugin_manager=pm)


# -- trust: reserved names, name clashes ----------------------------------------------------------------------------


def _install_entries(root, dist_name, version, module_name, source, entries):
    """Like _install_distribution, with several entry names pointing at one module."""
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    lines = "".join(f"{name} = {module_name}\n" for name in entries)
    (info / "entry_points.txt").write_text(f"[kernels_core.plugins]\n{lines}")


IMPOSTOR = """
from kernels_core import LayerKind, hookimpl

@hookimpl
def kernels_core_layer_kinds():
    return [LayerKind(name="nothing", description="x", variants=("v",), matcher="m:f", adapter="m:g")]
"""


def test_reserved_names_from_another_distribution_are_refused_before_import(site, caplog):
    _install_entries(site, "evil-plugin", "6.6.6", "demo_evil", IMPOSTOR, ["builtin", "portable"])
    _install_distribution(site, "demo-plugin", "1.0", "demo_good", GOOD, "demo")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        pm = _manager(allow=["demo", "portable"])
    assert "demo_evil" not in sys.modules, "a distribution claiming a reserved name must not even be imported"
    refused = [p for p in pm.plugins if p.status == "refused"]
    assert sorted(p.name for p in refused) == ["builtin", "portable"]
    assert all(p.distribution == "evil-plugin" and "reserved for kernels-core" in p.reason for p in refused)
    # The core's own plugins are the ones loaded, so its layer kinds and every other plugin keep working.
    loaded = {p.name: p for p in pm.plugins if p.status == "loaded"}
    assert loaded["builtin"].distribution == loaded["portable"].distribution == "kernels-core"
    assert "rms_norm" in pm.layer_kinds() and "nothing" not in pm.layer_kinds()
    assert "demo.rms_norm.x" in [k.spec.id for k in pm.kernels()]
    warned = [r.getMessage() for r in caplog.records if "evil-plugin 6.6.6" in r.getMessage()]
    assert len(warned) == 2 and all("refused" in w for w in warned)
    pm.invalidate()
    assert sum("evil-plugin" in c for c in pm.conflicts) == 2, "load-time clashes survive invalidate()"


def test_reserved_name_refusal_raises_in_strict_mode(site):
    _install_entries(site, "evil-plugin", "6.6.6", "demo_evil", IMPOSTOR, ["builtin"])
    with pytest.raises(PluginError, match="'builtin' is reserved for kernels-core.*evil-plugin 6.6.6"):
        _manager(strict=True)
    assert "demo_evil" not in sys.modules


def test_kernelize_still_binds_with_an_impostor_installed(site):
    import kernels_core

    torch = pytest.importorskip("torch")
    _install_entries(site, "evil-plugin", "6.6.6", "demo_evil", IMPOSTOR, ["builtin"])
    pm = _manager(allow=["portable"])
    model = kernels_core.kernelize(torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6)),
                                   mode=kernels_core.Mode.INFERENCE, plugin_manager=pm)
    assert [e.kernel for e in kernels_core.get_report(model).applied] == ["any.rms_norm.recompute"]


def test_a_name_advertised_twice_is_refused_listed_and_kept_after_invalidate(site, capsys):
    from kernels_core import _cli
    from kernels_core._plugins import _manager as manager_module

    _install_distribution(site, "demo-plugin", "1.0", "demo_good", GOOD, "demo")
    _install_distribution(site, "other-demo", "2.0", "demo_other", GOOD.replace("demo_good", "demo_other"), "demo")
    pm = _manager()
    statuses = sorted((p.status, p.distribution) for p in pm.plugins if p.name == "demo")
    assert len(statuses) == 2 and {s for s, _ in statuses} == {"loaded", "refused"}
    refused = next(p for p in pm.plugins if p.name == "demo" and p.status == "refused")
    assert "already taken by" in refused.reason and "was not imported" in refused.reason
    assert refused.module.replace("demo_good", "demo_other") == "demo_other"
    assert refused.module not in sys.modules
    pm.invalidate()
    assert any("'demo'" in c and "already taken" in c for c in pm.conflicts)
    previous = manager_module.reset_plugin_manager(pm)
    try:
        assert _cli.main(["plugins"]) == 0
        out = capsys.readouterr().out
        assert "refused" in out and "conflict:" in out and "already taken" in out
        assert _cli.main(["plugins", "--json"]) == 0
        data = __import__("json").loads(capsys.readouterr().out)
        assert any(p["status"] == "refused" and p["name"] == "demo" for p in data["plugins"])
        assert any("already taken" in c for c in data["conflicts"])
    finally:
        manager_module.reset_plugin_manager(previous)


def test_registering_a_reserved_name_in_process_is_refused():
    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    with pytest.raises(ValueError, match="'builtin' is reserved for kernels-core's own kernels_core._builtin"):
        pm.register(_plugin(), "builtin")


# -- hooks returning the wrong shape ------------------------------------------------------------------------------


def test_hook_returning_none_warns_once_and_is_listed(caplog):
    from kernels_core import _builtin

    def kernels_core_kernels():
        [_spec("forgot.return", 1)]  # noqa: B018 - the missing return is the point

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_kernels=kernels_core_kernels), "lazy", distribution="lazy-plugin", version="1")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        assert pm.kernels() == []
        pm.invalidate()
        pm.kernels()
    info = pm.info("lazy")
    assert info.status == "loaded" and "kernels_core_kernels returned None" in info.reason
    warned = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(warned) == 1 and "'lazy' (lazy-plugin 1)" in warned[0] and "return a list of KernelSpec" in warned[0]


def test_hook_returning_none_raises_in_strict_mode():
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=True)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_detect_devices=lambda: None), "lazy")
    with pytest.raises(PluginError, match="'lazy'.*kernels_core_detect_devices returned None"):
        pm.backends()


def test_hook_returning_a_single_value_says_to_wrap_it():
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_kernels=lambda: _spec("single.k", 1)), "single")
    assert pm.kernels() == []
    info = pm.info("single")
    assert info.status == "skipped" and "wrap a single value in a list" in info.reason


# -- spec validation: variants, backends ----------------------------------------------------------------------------


def test_kernel_with_a_variant_its_kind_lacks_is_rejected_with_the_allowed_variants(caplog):
    from kernels_core import _builtin

    def kernels():
        return [
            KernelSpec(id="odd.rms_norm.weird", kind="rms_norm", variants=("standard", "weird"), backend="cpu",
                       impl="m:f"),
            KernelSpec(id="odd.rms_norm.typo", kind="rms_norm", variants=("standrd",), backend="cpu", impl="m:f"),
            _spec("odd.rms_norm.fine", 1),
        ]

    pm = KernelsPluginManager(load_entrypoints=False, strict=False)
    pm.register(_builtin, "builtin")
    pm.register(_plugin(kernels_core_kernels=kernels), "odd", distribution="odd-plugin", version="0.2")
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        assert [k.spec.id for k in pm.kernels()] == ["odd.rms_norm.fine"], "the plugin's valid kernel stays"
    rejected = {spec.id: reason for spec, _plugin_info, reason in pm.rejected_kernels()}
    assert set(rejected) == {"odd.rms_norm.weird", "odd.rms_norm.typo"}
    assert "['weird']" in rejected["odd.rms_norm.weird"]
    assert "allowed variants: ['offset', 'standard']" in rejected["odd.rms_norm.weird"]
    assert "did you mean 'standrd' -> 'standard'?" in rejected["odd.rms_norm.typo"]
    assert pm.info("odd").status == "loaded" and "odd.rms_norm.weird" in pm.info("odd").reason
    assert any("'odd' (odd-plugin 0.2)" in r.getMessage() and "weird" in r.getMessage() for r in caplog.records)


def test_unknown_variant_raises_in_strict_mode():
    from kernels_core.testing import fresh_plugin_manager

    bad = KernelSpec(id="odd.k", kind="rms_norm", variants=("weird",), backend="cpu", impl="m:f")
    pm = fresh_plugin_manager((_plugin(kernels_core_kernels=lambda: [bad]), "odd"))
    with pytest.raises(PluginError, match="'odd'.*odd.k.*allowed variants"):
        pm.kernels()


@pytest.mark.parametrize("backend", ["cuda:0", "CUDA", "", "rocm 6"])
def test_backend_names_must_be_well_formed(backend):
    with pytest.raises(ValueError, match="lowercase backend name.*such as 'cuda'.*not a torch device"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend=backend, impl="m:f")
    with pytest.raises(ValueError, match="lowercase backend name"):
        BackendInfo(backend=backend, device_type="cuda")


def test_kernel_for_a_backend_no_plugin_detects_is_listed(capsys):
    import json

    from kernels_core import _cli
    from kernels_core._plugins import _manager as manager_module
    from kernels_core.testing import fresh_plugin_manager

    typo = KernelSpec(id="typo.rms_norm.k", kind="rms_norm", variants=("standard",), backend="cpuu",
                      impl="kernels_core._builtin:kernels_core_layer_kinds")
    npu = KernelSpec(id="npu.rms_norm.k", kind="rms_norm", variants=("standard",), backend="npu",
                     impl="kernels_core._builtin:kernels_core_layer_kinds")
    absent_npu = [BackendInfo(backend="npu", device_type="npu", reason="no torch_npu")]
    pm = fresh_plugin_manager((_plugin(kernels_core_kernels=lambda: [typo, npu],
                                       kernels_core_detect_devices=lambda: absent_npu), "vendor"))
    problems = pm.kernel_problems()
    assert [status for status, _ in problems["typo.rms_norm.k"]] == ["undetectable backend"]
    assert "'cpuu' is detected by no installed plugin" in problems["typo.rms_norm.k"][0][1]
    # A backend detected with zero devices is detectable, but nothing of it can run here.
    assert problems["npu.rms_norm.k"] == [("cannot run here", "no npu device detected (no torch_npu)")]
    previous = manager_module.reset_plugin_manager(pm)
    try:
        assert _cli.main(["kernels"]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("typo.rms_norm.k"))
        assert row.rstrip().endswith("undetectable backend")
        assert "undetectable backend: typo.rms_norm.k (vendor): backend 'cpuu'" in out
        assert _cli.main(["kernels", "--json"]) == 0
        data = {k["id"]: k for k in json.loads(capsys.readouterr().out)["kernels"]}
        assert data["typo.rms_norm.k"]["problems"][0]["status"] == "undetectable backend"
        assert data["npu.rms_norm.k"]["problems"] == [{"status": "cannot run here",
                                                       "detail": "no npu device detected (no torch_npu)"}]
    finally:
        manager_module.reset_plugin_manager(previous)


# -- declaration mistakes of a third-party author (mistaken_plugins.py): named, narrow, raised when strict -----------

def _lenient(*plugins):
    pm = fresh_plugin_manager(*plugins)
    pm.strict = False
    pm.invalidate()
    return pm


def test_a_misspelt_api_attribute_warns_with_the_right_name(caplog):
    import mistaken_plugins

    pm = _lenient((mistaken_plugins.MisspeltApi(), "acme"))
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        pm.kernels()
    reason = pm.info("acme").reason
    assert "unknown attribute 'KERNELS_CORE_PLUGIN_APl' (did you mean 'KERNELS_CORE_PLUGIN_API'?)" in reason
    assert any("KERNELS_CORE_PLUGIN_APl" in r.getMessage() and r.name == "kernels_core" for r in caplog.records)
    with pytest.raises(PluginError, match="KERNELS_CORE_PLUGIN_APl"):
        fresh_plugin_manager((mistaken_plugins.MisspeltApi(), "acme")).kernels()


def test_a_misspelt_kernel_spec_field_rejects_that_kernel_alone_naming_it_and_the_field():
    import mistaken_plugins

    pm = _lenient((mistaken_plugins.MisspeltField(), "acme"))
    assert pm.info("acme").status == PluginStatus.LOADED
    assert "acme.rms_norm.ok" in {k.spec.id for k in pm.kernels()}
    ((spec, info, reason),) = pm.rejected_kernels()
    assert spec.id == "acme.rms_norm.typo" and info.name == "acme"
    assert "KernelSpec has no field 'prority' (did you mean 'priority'?)" in reason
    with pytest.raises(PluginError, match=r"acme.rms_norm.typo.*'prority'"):
        fresh_plugin_manager((mistaken_plugins.MisspeltField(), "acme")).kernels()
    with pytest.raises(TypeError, match=r"kernel 'x.y': KernelSpec has no field 'prority' \(did you mean"):
        KernelSpec(id="x.y", kind="rms_norm", variants=("standard",), backend="any", impl="a:b", prority=1)


def test_a_kernel_id_conflict_goes_by_priority_is_told_to_both_and_raises_when_strict():
    import mistaken_plugins

    pm = _lenient((mistaken_plugins.Ok(), "acme"), (mistaken_plugins.IdThief(), "zeta"))
    (kernel,) = [k for k in pm.kernels() if k.spec.id == "acme.rms_norm.ok"]
    assert kernel.plugin.name == "zeta" and kernel.spec.priority == 500
    ((spec, info, reason),) = pm.rejected_kernels()
    assert info.name == "acme" and "'zeta''s (the highest priority) is used instead of this one" in reason
    assert any("'acme' (priority 100), 'zeta' (priority 500)" in c for c in pm.conflicts)
    with pytest.raises(PluginError, match="acme.rms_norm.ok"):
        fresh_plugin_manager((mistaken_plugins.Ok(), "acme"), (mistaken_plugins.IdThief(), "zeta")).kernels()
