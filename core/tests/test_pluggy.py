"""The hooks are pluggy's: tryfirst/trylast order the calls, wrappers see and edit results, and one plugin's
failure leaves the others' results standing."""

from __future__ import annotations

import logging
import types

import pytest
from kernels_core import KernelSpec
from kernels_core import KernelsPluginManager
from kernels_core import PluginError
from kernels_core.plugin import Binding
from kernels_core.plugin import hookimpl


def _spec(kernel_id, priority=1):
    return KernelSpec(id=kernel_id, kind="rms_norm", variants=("standard",), backend="cpu", impl="m:f",
                      priority=priority)


def _declaring(*ids, **hookimpl_options):
    plugin = types.ModuleType(f"plugin_{ids[0] if ids else 'empty'}")
    specs = [_spec(i) for i in ids]
    plugin.kernels_core_kernels = hookimpl(**hookimpl_options)(lambda: specs)
    return plugin


def _manager(*plugins, strict=False):
    from kernels_core import _builtin

    pm = KernelsPluginManager(load_entrypoints=False, strict=strict)
    pm.register(_builtin, "builtin")
    for plugin, name in plugins:
        pm.register(plugin, name, distribution=f"{name}-dist", version="1")
    return pm


class Recorder:
    """A third-party wrapper: records the lists it is sent, drops one kernel, adds one of its own."""

    def __init__(self, drop=None, add=None):
        self.seen = None
        self.drop, self.add = drop, add

    @hookimpl(wrapper=True)
    def kernels_core_kernels(self):
        results = yield
        self.seen = [[spec.id for spec in specs] for specs in results]
        edited = [[spec for spec in specs if spec.id != self.drop] for specs in results]
        return edited + ([[_spec(self.add)]] if self.add else [])


def test_tryfirst_and_trylast_order_the_results_a_wrapper_sees():
    recorder = Recorder()
    # Registration order says last-registered first; tryfirst and trylast override it, as pluggy documents.
    pm = _manager((_declaring("late.k", trylast=True), "late"), (_declaring("early.k", tryfirst=True), "early"),
                  (_declaring("plain.k"), "plain"), (recorder, "recorder"))
    pm.kernels()
    assert recorder.seen == [["early.k"], ["plain.k"], ["late.k"]]


def test_a_wrapper_edits_what_the_plugins_declared():
    recorder = Recorder(drop="plain.drop", add="recorder.added")
    pm = _manager((_declaring("plain.keep", "plain.drop"), "plain"), (recorder, "recorder"))
    kernels = {p.spec.id: p.plugin.name for p in pm.kernels()}
    assert kernels == {"plain.keep": "plain", "recorder.added": "recorder"}, "added entries are the wrapper's"
    assert pm.info("recorder").status == pm.info("plain").status == "loaded"


def test_a_raising_plugin_leaves_the_others_and_the_wrapper_standing(caplog):
    def kernels_core_kernels():
        raise RuntimeError("vendor library missing")

    broken = types.ModuleType("plugin_broken")
    broken.kernels_core_kernels = hookimpl(tryfirst=True)(kernels_core_kernels)
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        pm = _manager((broken, "broken"), (_declaring("good.k"), "good"), (recorder, "recorder"))
        assert [p.spec.id for p in pm.kernels()] == ["good.k"]
    assert recorder.seen == [["good.k"]], "the raising implementation gives no result; the call goes on"
    info = pm.info("broken")
    assert info.status == "skipped"
    assert "kernels_core_kernels raised RuntimeError: vendor library missing" in info.reason
    warned = [r.getMessage() for r in caplog.records if "vendor library missing" in r.getMessage()]
    assert len(warned) == 1 and "'broken' (broken-dist 1)" in warned[0]
    with pytest.raises(PluginError, match="'broken'.*vendor library missing"):
        _manager((broken, "broken"), (_declaring("good.k"), "good"), strict=True).kernels()


class RaisingWrapper:
    @hookimpl(wrapper=True)
    def kernels_core_kernels(self):
        yield
        raise ValueError("wrapper bug")


class MalformedWrapper:
    @hookimpl(wrapper=True)
    def kernels_core_kernels(self):
        yield  # forgets to return the results


@pytest.mark.parametrize(("wrapper", "problem"), [
    (RaisingWrapper(), "hook wrapper kernels_core_kernels raised ValueError: wrapper bug"),
    (MalformedWrapper(), "hook wrapper kernels_core_kernels returned NoneType"),
])
def test_a_broken_wrapper_is_skipped_and_the_results_it_was_sent_stand(wrapper, problem):
    pm = _manager((_declaring("good.k"), "good"), (wrapper, "wrapper"))
    assert [p.spec.id for p in pm.kernels()] == ["good.k"]
    assert pm.info("wrapper").status == "skipped" and problem in pm.info("wrapper").reason


def test_an_old_style_hookwrapper_is_refused_at_registration():
    class OldStyle:
        @hookimpl(hookwrapper=True)
        def kernels_core_kernels(self):
            yield

    pm = _manager((OldStyle(), "old"), (_declaring("good.k"), "good"))
    assert pm.info("old").status == "failed" and "wrapper=True" in pm.info("old").reason
    assert [p.spec.id for p in pm.kernels()] == ["good.k"]


def test_calling_pm_hook_directly_is_isolated_too(caplog):
    def kernels_core_kernels():
        raise RuntimeError("boom")

    broken = types.ModuleType("plugin_broken")
    broken.kernels_core_kernels = hookimpl(kernels_core_kernels)
    pm = _manager((broken, "broken"), (_declaring("good.k"), "good"))
    with caplog.at_level(logging.WARNING, logger="kernels_core"):
        results = pm.pluggy_manager.hook.kernels_core_kernels()
    assert [[spec.id for spec in specs] for specs in results] == [["good.k"]]
    assert any("'broken'" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)


def test_the_bind_hook_is_called_through_pluggy_on_the_owning_plugin_only():
    import kernels_core
    import torch
    from kernels_core import Mode

    calls = []

    class Owner:
        @hookimpl
        def kernels_core_kernels(self):
            return [KernelSpec(id="owner.rms_norm", kind="rms_norm", variants=("standard",), backend="cpu",
                               impl="kernels_core.testing:reference.rms_norm", priority=50)]

        @hookimpl
        def kernels_core_bind_kernel(self, module, match, kernel, forward):
            calls.append(("owner", kernel.id))
            return None  # the core's default binding

        @hookimpl(wrapper=True, specname="kernels_core_bind_kernel")
        def wrap_bind(self, module, match, kernel, forward):
            binding = yield
            calls.append(("owner wrapper saw", binding))
            return Binding({"forward": forward, "kernel_tag": kernel.id})

    class Other:
        @hookimpl(tryfirst=True)
        def kernels_core_bind_kernel(self, module, match, kernel, forward):
            calls.append(("other", kernel.id))
            return Binding({"forward": lambda *a, **k: None})

    pm = _manager((Owner(), "owner"), (Other(), "other"))
    model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(2, 8)
    expected = model(x)
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    assert calls == [("owner", "owner.rms_norm"), ("owner wrapper saw", None)], "firstresult among the owner's"
    assert model[0].kernel_tag == "owner.rms_norm"
    torch.testing.assert_close(model(x), expected)
    kernels_core.unkernelize(model)
    assert "kernel_tag" not in model[0].__dict__
