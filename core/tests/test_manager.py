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
from kernels_core import PluginError
from kernels_core import hookimpl


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
    assert any("'dup.k' declared by 'alpha' and 'beta'" in c for c in pm.conflicts)
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
