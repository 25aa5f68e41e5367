"""The ``causal_mask`` kind on real transformers models: what SDPA receives under ``torch.compile``, and the math.

Each compiled run records the graphs Dynamo hands its backend and reads the ``scaled_dot_product_attention`` calls
in them: with the kernel, unpadded causal inputs must reach SDPA as ``attn_mask=None, is_causal=True`` (whatever
the installed transformers does on its own), and everything that needs a mask (padding, packed position ids)
must still get one. Logits are compared with the eager, un-kernelized model every time.
"""

from __future__ import annotations

import copy
import pickle

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("transformers")

COMPILED = Mode.INFERENCE | Mode.TORCH_COMPILE


def _sdpa_calls(model, **inputs):
    """(output, [(mask is None, is_causal) per SDPA call]) of one compiled call, through a recording backend."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    output = torch.compile(model, backend=record, fullgraph=True)(**inputs)
    calls = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask is None, bool(node.kwargs.get("is_causal", False))))
    return output, calls


def _entry(model, kind):
    return next(e for e in kernels_core.get_report(model).entries if e.kind == kind)


@pytest.fixture(params=["qwen3", "llama"])
def model(request):
    return tiny_causal_lm(request.param, attn_implementation="sdpa").eval()


def test_base_model_is_matched_and_bound(model, pm):
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    entry = _entry(model, "causal_mask")
    assert (entry.module, entry.variant, entry.kernel) == ("model", "sdpa", "any.causal_mask.sdpa_is_causal")


@pytest.mark.parametrize("use_cache", [True, False], ids=["empty-cache", "no-cache"])
def test_unpadded_inputs_reach_sdpa_as_is_causal(model, pm, use_cache):
    ids = torch.randint(3, 101, (2, 7))
    expected = model(input_ids=ids, use_cache=use_cache).logits
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    output, calls = _sdpa_calls(model, input_ids=ids, use_cache=use_cache)
    assert calls == [(True, True)] * model.config.num_hidden_layers
    assert_close(output.logits, expected, what="logits")


def test_training_step_with_the_fused_loss_reaches_sdpa_as_is_causal(model, pm):
    # The fused loss builds no cache, so the mask would depend on whether positions are packed: the model
    # derives them itself here (none passed), which the kernel is told.
    model.train()
    ids = torch.randint(3, 101, (2, 7))
    kernels_core.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=pm)
    _, calls = _sdpa_calls(model, input_ids=ids, labels=ids)
    assert calls == [(True, True)] * model.config.num_hidden_layers


def _count_packing_checks(monkeypatch) -> list:
    """Counts transformers' checks of position ids for packed sequences (each reads a device value: a host sync
    on a GPU)."""
    import transformers.masking_utils as masking_utils

    calls = []
    original = masking_utils.find_packed_sequence_indices

    def counting(position_ids):
        calls.append(position_ids)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    return calls


def test_eager_training_step_never_checks_derived_positions_for_packing(model, pm, monkeypatch):
    # The fused loss runs the base model without a cache, where transformers would check the positions the model
    # derived itself for packing once per step (a host sync on a GPU); they never are packed.
    model.train()
    ids = torch.randint(3, 101, (2, 7))
    expected = model(input_ids=ids, labels=ids).loss
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    checks = _count_packing_checks(monkeypatch)
    loss = model(input_ids=ids, labels=ids).loss
    assert checks == []
    assert_close(loss, expected, what="loss")


def test_eager_packed_position_ids_are_still_checked_and_keep_their_block_mask(model, pm, monkeypatch):
    ids = torch.randint(3, 101, (2, 7))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)
    expected = model(input_ids=ids, position_ids=packed, use_cache=False).logits
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    checks = _count_packing_checks(monkeypatch)
    output = model(input_ids=ids, position_ids=packed, use_cache=False).logits
    assert len(checks) == 1
    assert_close(output, expected, what="logits")


def test_padding_keeps_its_mask(model, pm):
    ids = torch.randint(3, 101, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[0, :3] = 0
    expected = model(input_ids=ids, attention_mask=padding).logits
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    output, calls = _sdpa_calls(model, input_ids=ids, attention_mask=padding)
    assert calls and not any(mask_is_none for mask_is_none, _ in calls)
    # Fully padded query rows are undefined in both; compare the real tokens.
    assert_close(output.logits[padding.bool()], expected[padding.bool()], what="logits")


def test_packed_position_ids_keep_their_block_mask(model, pm):
    # Two sequences packed in each row: without a cache transformers builds a block-diagonal mask from the
    # positions, which SDPA's is_causal cannot express.
    ids = torch.randint(3, 101, (2, 7))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)
    expected = model(input_ids=ids, position_ids=packed, use_cache=False).logits
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    output, calls = _sdpa_calls(model, input_ids=ids, position_ids=packed, use_cache=False)
    assert calls and not any(mask_is_none for mask_is_none, _ in calls)
    assert_close(output.logits, expected, what="logits")


def test_eager_attention_is_declined_with_the_reason(pm):
    model = tiny_causal_lm("qwen3", attn_implementation="eager")
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    entry = _entry(model, "causal_mask")
    assert entry.kernel is None and "attention implementation is 'eager'" in entry.reason


def test_decorators_keep_working_and_unkernelize_restores_the_class_forward(model, pm):
    # transformers wraps base-model forwards (capture_outputs collects hidden states): the rerouted copy must keep
    # those wrappers, so output_hidden_states still works.
    ids = torch.randint(3, 101, (1, 5))
    expected = model(input_ids=ids, output_hidden_states=True).hidden_states
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    actual = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, what="logits")
    kernels_core.unkernelize(model)
    assert "forward" not in model.model.__dict__


def test_copies_stay_kernelized(model, pm):
    ids = torch.randint(3, 101, (2, 7))
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        # A copied layer forward (KernelForward) builds its kernel at its first call (outside the graph when that
        # call is compiled: one break); one eager call first keeps the compiled one in a single graph.
        clone(input_ids=ids)
        _, calls = _sdpa_calls(clone, input_ids=ids)
        assert calls == [(True, True)] * model.config.num_hidden_layers


def test_one_compiled_model_keeps_each_calls_mask_whether_positions_are_given_or_derived(model, pm):
    # Whether the caller passed position ids selects which rerouted forward runs; under torch.compile that choice is
    # made from which arguments are None, so one graph per choice is traced and each call gets its own mask.
    ids = torch.randint(3, 101, (2, 7))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)
    expected = {"derived": model(input_ids=ids, use_cache=False).logits,
                "packed": model(input_ids=ids, position_ids=packed, use_cache=False).logits}
    kernels_core.kernelize(model, mode=COMPILED, plugin_manager=pm)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=record, fullgraph=True)
    for _ in range(2):  # the second round must reuse the first round's graphs (guards neither too loose nor stale)
        assert_close(compiled(input_ids=ids, use_cache=False).logits, expected["derived"], what="derived positions")
        assert_close(compiled(input_ids=ids, position_ids=packed, use_cache=False).logits, expected["packed"],
                     what="packed positions")
    assert len(graphs) == 2, f"{len(graphs)} graphs for two kinds of call"
