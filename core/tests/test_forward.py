"""Rerouted forwards: decorator chains re-created around the rerouted copy, or refused with the reason."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from kernels_core._forward import ForwardPlan
from kernels_core._forward import KernelForward
from kernels_core._forward import PlannedKernel
from kernels_core._forward import ReroutedForward
from kernels_core._forward import decorator_chain_problem
from kernels_core._forward import rewrap
from kernels_core._plugins._records import PluginInfo
from kernels_core._plugins._records import ProvidedKernel
from kernels_core._plugins._records import ProvidedKind
from kernels_core._types import KernelSpec
from kernels_core._types import LayerKind
from kernels_core._types import Match


def _counting(log: list):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            log.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def test_a_wraps_chain_is_rebuilt_around_the_new_function_and_keeps_running():
    log: list = []

    @_counting(log)
    @_counting(log)
    def original(x):
        return x + 1

    def replacement(x):
        return x * 10

    assert decorator_chain_problem(original) is None
    rebuilt = rewrap(original, replacement)
    # Both wrappers ran; the innermost one now calls the replacement.
    assert rebuilt(2) == 20 and len(log) == 2 and log[-1] == "replacement"
    # The original chain is untouched.
    assert original(2) == 3


def test_a_wrapper_holding_the_function_elsewhere_is_refused_by_name():
    def original(x):
        return x

    class Holder:
        fn = staticmethod(original)

    def opaque(*args):
        return Holder.fn(*args)

    opaque.__wrapped__ = original
    problem = decorator_chain_problem(opaque)
    assert problem is not None and "opaque" in problem and "closure cell" in problem


def test_a_non_function_forward_is_refused():
    assert decorator_chain_problem(functools.partial(print)) == "the class forward is not a plain Python function"


# -- exceptions raised through a kernelized forward -----------------------------------------------------------------

def double(x):
    return x * 2


def boom(x):
    raise KeyError("boom in the kernel")


def pass_impl(module, match, impl, options):
    return impl


class Doubler(torch.nn.Module):
    def forward(self, x):
        return double(x)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Doubler()

    def forward(self, x):
        return double(self.inner(x))


def _planned(kernel_id, impl, *, plugin="", origin=None, target="forward", global_name=None):
    distribution, _, version = (origin or "").partition(" ")
    info = PluginInfo(name=plugin, module="", distribution=distribution or None, version=version or None)
    spec = KernelSpec(id=kernel_id, kind="doubling", variants=("plain",), backend="any", impl=f"{__name__}:{impl}")
    kind = LayerKind(name="doubling", description="", variants=("plain",), matcher=f"{__name__}:pass_impl",
                     adapter=f"{__name__}:pass_impl", target=target)
    params = {"global_name": global_name} if global_name else {}
    return PlannedKernel(ProvidedKernel(spec, info), ProvidedKind(kind, info), Match("doubling", "plain", params), {})


def _kernel_forward(module, impl, *, module_name="", **extra):
    return KernelForward(ForwardPlan(module_name, module, (_planned("acme.double.k", impl, **extra),)))


def _notes(exc):
    return [n for n in getattr(exc, "__notes__", ()) if n.startswith("kernels-core:")]


def test_kernel_forward_exception_keeps_its_type_and_gets_one_note():
    module = Doubler()
    forward = _kernel_forward(module, "boom", plugin="acme", origin="kernels-acme 1.0", module_name="layers.3.mlp")
    with pytest.raises(KeyError, match="boom in the kernel") as info:
        forward(torch.ones(2))
    (note,) = _notes(info.value)
    for part in ("'acme.double.k'", "plugin 'acme' (kernels-acme 1.0)", "module 'layers.3.mlp' (Doubler)",
                 f"impl {__name__}:boom", 'kernels.disable = ["acme.double.k"]'):
        assert part in note, part


def test_rerouted_forward_exception_names_every_kernel_and_only_the_innermost_forward_adds_a_note():
    outer = Outer()
    outer.inner.forward = _kernel_forward(outer.inner, "boom", plugin="acme", origin="kernels-acme 1.0",
                                          module_name="inner")
    override = _planned("acme.double.global", "double", plugin="acme", origin="kernels-acme 1.0", target="global",
                        global_name="double")
    rerouted = ReroutedForward(ForwardPlan("outer", outer, (override,)))
    with pytest.raises(KeyError) as info:
        rerouted(torch.ones(2))
    (note,) = _notes(info.value)
    assert "'acme.double.k'" in note and "module 'inner'" in note
    outer.inner.__dict__.pop("forward")
    outer.inner.forward = lambda x: boom(x)
    with pytest.raises(KeyError) as info:
        rerouted(torch.ones(2))
    (note,) = _notes(info.value)
    assert "module 'outer' (Outer)" in note and "'acme.double.global' for double (plugin 'acme'" in note
    assert 'kernels.disable = ["acme.double.global"]' in note


def test_a_working_forward_is_unchanged_and_a_copy_runs_the_same_kernel():
    module = Doubler()
    assert torch.equal(_kernel_forward(module, "double")(torch.ones(2)), torch.full((2,), 2.0))
    # A kernel no installed plugin declares: a copy keeps what its original found instead of looking it up again.
    clone = copy.deepcopy(_kernel_forward(module, "boom", plugin="acme", module_name="inner"))
    assert clone.module is not module and clone.module_name == "inner"
    with pytest.raises(KeyError) as info:
        clone(torch.ones(2))
    assert "'acme.double.k'" in _notes(info.value)[0]


# --- the bound forward: a method, for torch.compile of one layer at a time ---------------------------------------


def _kernelized_layers(layers: int, mode=None):
    import kernels_core
    from kernels_core.testing import tiny_causal_lm

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3", num_hidden_layers=layers)
    model.config.use_cache = False
    model.train()
    kernels_core.kernelize(model, mode=mode or (kernels_core.Mode.TRAINING | kernels_core.Mode.TORCH_COMPILE))
    return model


# Dynamo reads the .grad of non-leaf activations while it builds the layers' inputs (torch 2.13), and warns.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_each_layer_compiled_alone_traces_one_graph_for_all():
    """FSDP2 recipes compile each decoder layer alone. Dynamo guards a module's replaced forward by identity unless
    it is a method (then by its function's code): with a callable object bound, every layer traced again and after
    Dynamo's recompile limit (8) the rest ran uncompiled. Twelve layers must share one graph, as without kernelize."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _kernelized_layers(12)
    torch._dynamo.reset()
    counters.clear()
    for index, layer in enumerate(model.model.layers):
        model.model.layers[index] = torch.compile(layer, backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch._dynamo.config.patch(recompile_limit=64):  # so a regression counts every recompile
        model(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_the_bound_method_keeps_the_module_signature_and_survives_copies():
    import inspect
    import pickle

    import kernels_core

    model = _kernelized_layers(1, mode=kernels_core.Mode.TRAINING)
    bound = model.__dict__["forward"]
    assert inspect.ismethod(bound) and isinstance(bound.__self__, KernelForward)
    # transformers' Trainer keeps the dataset columns model.forward names; generate reads it too.
    expected = inspect.signature(type(model).forward.__get__(model, type(model)))
    assert inspect.signature(model.forward) == expected
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        forward = clone.__dict__["forward"]
        assert forward.__self__.module is clone and forward.__self__ is not bound.__self__
        assert inspect.signature(clone.forward) == expected
        ids = torch.randint(0, clone.config.vocab_size, (1, 6))
        torch.testing.assert_close(clone(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)
