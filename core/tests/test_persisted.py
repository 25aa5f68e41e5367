"""Saved and copied kernelized models: kernel ids and a state version in the pickle, kernels found again on load."""

from __future__ import annotations

import copyreg
import io
import pickle
from collections import Counter

import kernels_core
import pytest
import torch
from kernels_core import KernelFallbackWarning
from kernels_core import KernelizeError
from kernels_core import Mode
from kernels_core import reset_plugin_manager
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm
from round_trips import round_trip


pytest.importorskip("transformers")

HOW = ["pickle", "torch_save", "deepcopy"]


@pytest.fixture
def installed(pm):
    """The built-in plugin and the portable kernels, as the process-wide plugin manager loads look kernels up in."""
    previous = reset_plugin_manager(pm)
    yield pm
    reset_plugin_manager(previous)




def _kernelized(pm, *, config=None):
    model = tiny_causal_lm("llama").eval()
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm, config=config)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _counting_rms_norm(monkeypatch) -> Counter:
    """Count calls of the portable RMSNorm kernel built from now on (a forward built earlier holds the original)."""
    from kernels_core._portable import _rms_norm

    calls: Counter = Counter()
    real = _rms_norm.rms_norm

    def counted(*args, **kwargs):
        calls["rms_norm"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_rms_norm, "rms_norm", counted)
    return calls


@pytest.mark.parametrize("how", HOW)
def test_a_copy_runs_the_kernels_it_was_saved_with(installed, monkeypatch, how):
    model = _kernelized(installed)
    report = kernels_core.get_report(model)
    norms = sum(e.kernel == "any.rms_norm.recompute" for e in report.applied)
    assert norms == 3, report.table()
    ids = torch.randint(3, 100, (2, 7))
    expected = _logits(model, ids)
    calls = _counting_rms_norm(monkeypatch)
    clone = round_trip(model, how)
    assert torch.equal(_logits(clone, ids), expected)
    assert calls["rms_norm"] == norms, "every bound RMSNorm of the copy runs the kernel it was saved with"
    assert kernels_core.get_report(clone) == report
    assert clone.model.norm.forward.__self__.module is clone.model.norm
    kernels_core.unkernelize(clone)
    assert not any("forward" in m.__dict__ for m in clone.modules())


@pytest.mark.parametrize("how", ["pickle", "torch_save"])
def test_saved_bytes_name_kernel_ids_and_no_private_module(installed, how):
    model = _kernelized(installed)
    if how == "pickle":
        saved = pickle.dumps(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        saved = buffer.getvalue()
    for private in (b"kernels_core._", b"kernels_triton._", b"_rms_norm:rms_norm", b"_norms:adapt_rms_norm"):
        assert private not in saved, private
    assert b"kernels_core.persisted" in saved
    for kernel in ("any.rms_norm.recompute", "any.silu_gated_mlp.recompute", "any.causal_mask.sdpa_is_causal"):
        assert kernel.encode() in saved, kernel


def test_the_installed_plugins_bind_nothing_private_into_a_saved_model():
    # Whatever plugins this environment has (kernels-triton binds a CPU kernel when it is installed).
    model = tiny_causal_lm("llama")
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    saved = pickle.dumps(model)
    assert kernels_core.get_report(model).applied
    assert b"kernels_core._" not in saved and b"kernels_triton._" not in saved


@pytest.mark.parametrize("how", ["pickle", "torch_save"])
def test_a_kernel_not_installed_where_the_model_loads_falls_back_and_says_how_to_kernelize_again(installed, how):
    model = _kernelized(installed)
    ids = torch.randint(3, 100, (2, 7))
    expected = _logits(model, ids)
    reset_plugin_manager(fresh_plugin_manager(portable=False))
    clone = round_trip(model, how)  # loads: nothing is looked up until it would run
    with pytest.warns(KernelFallbackWarning) as caught:
        got = _logits(clone, ids)
    torch.testing.assert_close(got, expected)
    message = next(str(w.message) for w in caught if "any.rms_norm.recompute" in str(w.message))
    assert "is not installed where the model was loaded" in message
    assert "the module's own forward runs instead" in message and "kernels_core.kernelize(model) again" in message
    now = kernels_core.get_report(clone)
    assert not now.applied
    fell = {e.fell_back for e in now.entries if e.fell_back}
    assert {"any.rms_norm.recompute", "any.causal_mask.sdpa_is_causal"} <= fell
    entry = next(e for e in now.entries if e.fell_back == "any.rms_norm.recompute")
    assert "is not installed where the model was loaded" in entry.reason
    # Kernelizing again chooses among what is installed here.
    kernels_core.kernelize(clone, mode=Mode.INFERENCE)
    assert not [e for e in kernels_core.get_report(clone).entries if e.fell_back]


def test_a_preferred_kernel_not_installed_where_the_model_loads_raises_at_each_call(installed):
    model = _kernelized(installed, config={"kinds": {"rms_norm": {"prefer": {"any": ["any.rms_norm.recompute"]}}}})
    reset_plugin_manager(fresh_plugin_manager(portable=False))
    clone = round_trip(model, "pickle")
    # The automatically chosen kernels (the causal mask, the decoder layers around the norm) fall back and warn.
    with pytest.warns(KernelFallbackWarning), pytest.raises(
            KernelizeError, match=r"'any.rms_norm.recompute', preferred by configuration, cannot run") as info:
        _logits(clone, torch.randint(3, 100, (1, 5)))
    assert "is not installed where the model was loaded" in str(info.value)
    assert "Kernelize the model again" in str(info.value)


def test_a_state_version_this_kernels_core_does_not_read_is_refused_with_what_to_do():
    from kernels_core.persisted import STATE_VERSION
    from kernels_core.persisted import restore

    with pytest.raises(pickle.UnpicklingError, match="reads versions up to") as info:
        restore(STATE_VERSION + 1, "KernelForward")
    assert "kernels_core.unkernelize(model) before saving" in str(info.value)


# -- pickles written by kernels-core 0.1.0 ----------------------------------------------------------------------------

def _saved_by_0_1_0(model, monkeypatch) -> bytes:
    """``model`` pickled as kernels-core 0.1.0 wrote it (``torch.save``'s protocol 2): every kernels-core object
    under its class's own module path (the binding record and its MISSING marker in kernels_core._forward), the
    forwards with their code references (``impl``, ``adapter``) and derived values, the built callable left out."""
    from kernels_core import _binding
    from kernels_core import _forward
    from kernels_core import _report
    from kernels_core import _types

    class BindingRecord:
        pass

    class Missing:
        def __reduce__(self):
            return "MISSING"

    for cls, name in ((BindingRecord, "BindingRecord"), (Missing, "Missing")):
        cls.__module__, cls.__qualname__ = "kernels_core._forward", name
    old_missing = Missing()

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, _forward._LazyForward):
                state = {k: v for k, v in obj.__dict__.items() if k not in ("_unresolved", "_globals")}
                state["_fn"] = None
                if isinstance(obj, _forward.ReroutedForward):
                    state.update(_scoped=(), _variants=None)
                return copyreg.__newobj__, (type(obj),), state
            if isinstance(obj, (_forward.Declared, _forward.GlobalOverride, _types.Match, _report.ReportEntry,
                                _report.KernelizeReport)):
                return copyreg.__newobj__, (type(obj),), dict(obj.__dict__)
            return NotImplemented

    buffer = io.BytesIO()
    with monkeypatch.context() as patch:
        patch.setattr(_forward, "BindingRecord", BindingRecord)
        patch.setattr(_forward, "MISSING", old_missing)
        for module in model.modules():
            record = module.__dict__.get(_binding.BINDING_ATTR)
            if record is not None:
                old = BindingRecord()
                old.__dict__.update(previous={k: old_missing if v is _binding.MISSING else v
                                              for k, v in record.previous.items()},
                                    kernels=record.kernels, bound=record.bound)
                patch.setitem(module.__dict__, _binding.BINDING_ATTR, old)
        Pickler(buffer, protocol=2).dump(model)
    return buffer.getvalue()


def test_a_model_saved_by_0_1_0_loads_and_finds_its_kernels_by_id(installed, monkeypatch):
    model = _kernelized(installed)
    ids = torch.randint(3, 100, (2, 7))
    expected = _logits(model, ids)
    saved = _saved_by_0_1_0(model, monkeypatch)
    # The fixture is the old format: private class paths and code references, no kernels_core.persisted.
    for old in (b"ckernels_core._forward\nKernelForward\n", b"ckernels_core._forward\nBindingRecord\n",
                b"ckernels_core._forward\nMISSING\n", b"kernels_core._portable._rms_norm:rms_norm"):
        assert old in saved, old
    assert b"kernels_core.persisted" not in saved
    calls = _counting_rms_norm(monkeypatch)
    clone = pickle.loads(saved)
    assert torch.equal(_logits(clone, ids), expected)
    assert calls["rms_norm"] == 3
    assert kernels_core.get_report(clone) == kernels_core.get_report(model)
    # Saved again, it is in the current format; unkernelize restores it exactly.
    assert b"kernels_core._" not in pickle.dumps(clone)
    kernels_core.unkernelize(clone)
    assert not any("forward" in m.__dict__ or "_kernels_core_binding" in m.__dict__ for m in clone.modules())


def test_a_model_saved_by_0_1_0_whose_kernel_is_gone_falls_back_with_the_message(installed, monkeypatch):
    model = _kernelized(installed)
    saved = _saved_by_0_1_0(model, monkeypatch)
    reset_plugin_manager(fresh_plugin_manager(portable=False))
    clone = pickle.loads(saved)
    with pytest.warns(KernelFallbackWarning) as caught:
        _logits(clone, torch.randint(3, 100, (1, 5)))
    assert any("'any.rms_norm.recompute'" in str(w.message) and "is not installed" in str(w.message)
               and "kernels_core.kernelize(model) again" in str(w.message) for w in caught)
