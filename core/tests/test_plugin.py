"""``kernels_core.plugin``, the public plugin API: its version contract, its names and its tolerance table."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types

import pytest
from kernels_core import KernelSpec
from kernels_core import KernelsPluginManager
from kernels_core import PluginError
from kernels_core import plugin
from kernels_core.plugin import PLUGIN_API_VERSION
from kernels_core.plugin import hookimpl


def _plugin(api=None, calls=None):
    module = types.ModuleType("plugin_versioned")
    if api is not None:
        module.KERNELS_CORE_PLUGIN_API = api

    @hookimpl
    def kernels_core_kernels():
        if calls is not None:
            calls.append("kernels")
        return [KernelSpec(id="versioned.k", kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f")]

    module.kernels_core_kernels = kernels_core_kernels
    return module


def _manager(strict=False):
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=strict)
    pm.register(_builtin, "builtin")
    return pm


@pytest.mark.parametrize("api", ["1.0", "1.7", None], ids=["1.0", "1.7", "not stated"])
def test_a_plugin_for_api_1_loads(api):
    pm = _manager()
    info = pm.register(_plugin(api), "versioned", distribution="versioned-dist", version="3")
    assert (info.status, info.reason, info.api_version) == ("loaded", None, api)
    assert [p.spec.id for p in pm.kernels()] == ["versioned.k"]


@pytest.mark.parametrize(("api", "reason"), [
    ("2.0", "written for kernels-core's plugin API 2.0, but this kernels-core provides 1.0"),
    ("one", "KERNELS_CORE_PLUGIN_API = 'one', which is not a 'MAJOR.MINOR' version string"),
    (1.0, "KERNELS_CORE_PLUGIN_API = 1.0, which is not a 'MAJOR.MINOR' version string"),
])
def test_a_plugin_for_another_api_is_refused_with_the_reason(api, reason, caplog, capsys):
    from kernels_core import _cli
    from kernels_core._plugins import _manager as manager_module

    calls = []
    pm = _manager()
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        info = pm.register(_plugin(api, calls), "versioned", distribution="versioned-dist", version="3")
        assert pm.kernels() == [] and calls == [], "none of its hooks is called"
    assert info.status == "refused" and reason in info.reason
    warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 1 and "'versioned' (versioned-dist 3)" in warned[0] and reason in warned[0]
    previous = manager_module.reset_plugin_manager(pm)
    try:
        assert _cli.main(["plugins", "--json"]) == 0
        listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
        assert listed["versioned"]["status"] == "refused" and reason in listed["versioned"]["reason"]
    finally:
        manager_module.reset_plugin_manager(previous)
    with pytest.raises(PluginError, match="'versioned'.*refused"):
        _manager(strict=True).register(_plugin(api), "versioned")


def test_every_in_tree_plugin_states_the_api_it_is_written_for():
    from importlib.metadata import entry_points

    import kernels_core._builtin
    import kernels_core._builtin.portable

    modules = [kernels_core._builtin, kernels_core._builtin.portable]
    # The other plugins through their entry points, as kernels-core finds them: their plugin modules are private.
    for entry_point in entry_points(group="kernels_core.plugins"):
        try:
            modules.append(entry_point.load())
        except ImportError:  # a plugin whose dependencies the environment does not hold
            continue
    assert {getattr(m, "KERNELS_CORE_PLUGIN_API", None) for m in modules} == {PLUGIN_API_VERSION}


def test_the_public_module_holds_what_a_plugin_author_needs():
    import kernels_core
    from kernels_core import testing
    from kernels_core._kinds import _context

    for name in plugin.__all__:
        assert getattr(plugin, name) is not None, name
    assert plugin.MatchContext is _context.MatchContext
    assert plugin.ConformanceCase is testing.ConformanceCase
    assert plugin.hookimpl is kernels_core.hookimpl and plugin.KernelSpec is kernels_core.KernelSpec
    assert {"kernels_core_detect_devices", "kernels_core_layer_kinds", "kernels_core_kernels",
            "kernels_core_bind_kernel"} <= set(vars(plugin.Hooks))
    with pytest.raises(AttributeError):
        plugin.NoSuchName  # noqa: B018


def test_importing_the_public_module_imports_no_torch():
    code = "import kernels_core.plugin, sys, json; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout.strip().splitlines()[-1]))
    assert "torch" not in loaded


def test_one_tolerance_table():
    torch = pytest.importorskip("torch")
    from kernels_core import testing

    for name, bounds in plugin.TOLERANCES.items():
        dtype = getattr(torch, name)
        assert plugin.probe_tolerance(dtype) == plugin.probe_tolerance(name) == bounds.probe
        assert testing.tolerance(dtype) == plugin.kernel_tolerance(dtype) == bounds.kernel
    # Half precision rounds more than single, and a probe (same math?) is looser than a kernel check.
    assert plugin.kernel_tolerance(torch.bfloat16) > plugin.kernel_tolerance(torch.float32)
    assert all(bounds.probe >= bounds.kernel for bounds in plugin.TOLERANCES.values())
    expected = torch.tensor([1.0, -2.0, 4.0])
    assert plugin.probe_close(expected * (1 + 5e-5), expected, torch.float32)
    assert not plugin.probe_close(expected * 1.01, expected, torch.float32)
    assert plugin.probe_close(expected * 1.01, expected, torch.bfloat16)
    assert not plugin.probe_close(expected.to(torch.bfloat16), expected, torch.bfloat16), "another dtype"
    assert not plugin.probe_close(expected * float("nan"), expected, torch.float32)
