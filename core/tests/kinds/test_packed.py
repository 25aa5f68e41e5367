"""Packed rows (several documents in one row): a kernelized model computes what eager transformers computes in the
same setting, in every form packed batches reach a model.

transformers (sdpa) masks attention per document only where it looks for packing: position ids given, no attention
mask, no cache. With a cache (``use_cache=True``, the config default) it attends across the documents. Each test
compares against eager in the same setting, and, where eager is per document, against each document run alone.
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")

DOCUMENTS = (5, 9, 3, 7)  # odd lengths; one row of 24 tokens


def _packed(lengths: tuple[int, ...] = DOCUMENTS, *, vocab: int = 101, seed: int = 0) -> dict[str, torch.Tensor]:
    """One flattened row as DataCollatorWithFlattening builds it: restarting position ids, -100 at each start."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _model(family: str = "qwen3", *, use_cache: bool, dtype: torch.dtype = torch.float32,
           **overrides) -> torch.nn.Module:
    model = tiny_causal_lm(family, dtype=dtype, **overrides)
    model.config.use_cache = use_cache  # tiny_causal_lm turns it off; the config default of real checkpoints is on
    return model.train()


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _kernelized_copy(model: torch.nn.Module, pm) -> torch.nn.Module:
    import copy

    twin = copy.deepcopy(model)
    kernels_core.kernelize(twin, mode=Mode.TRAINING, plugin_manager=pm)
    return twin


@pytest.mark.parametrize("use_cache", [True, False], ids=["config-use-cache", "config-no-cache"])
def test_fused_loss_keeps_eager_masking_of_packed_rows(pm, use_cache):
    """The fused causal-LM loss builds no cache where that changes nothing; on packed rows it does change the mask,
    so the kernelized model attends across documents exactly where eager does (config ``use_cache=True``)."""
    model = _model(use_cache=use_cache)
    batch = _packed()
    eager_loss, eager_grads = _loss_and_grads(model, batch)
    twin = _kernelized_copy(model, pm)
    assert any(e.applied and e.kind == "causal_lm_loss" for e in kernels_core.get_report(twin).entries)
    loss, grads = _loss_and_grads(twin, batch)
    assert_close(loss, eager_loss, dtype=torch.float32)
    for name, grad in eager_grads.items():
        assert_close(grads[name], grad, dtype=torch.float32)
    # The two settings differ (otherwise this test could not tell them apart).
    other = _model(use_cache=not use_cache)
    other.load_state_dict(model.state_dict())
    assert not torch.allclose(_loss_and_grads(other, batch)[0], eager_loss)


def test_explicit_use_cache_argument_wins(pm):
    model = _model(use_cache=True)
    batch = _packed()
    eager = model(**batch, use_cache=False).loss
    twin = _kernelized_copy(model, pm)
    assert_close(twin(**batch, use_cache=False).loss, eager, dtype=torch.float32)


# --- the packed_attention kind ---------------------------------------------------------------------------------------

from kernels_core._kinds._packed import documents_of  # noqa: E402


def _doc_mask(lengths, *, window=None):
    document = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    index = torch.arange(len(document))
    distance = index[:, None] - index[None, :]
    mask = (document[:, None] == document[None]) & (distance >= 0)
    if window is not None:
        mask &= distance < window
    return mask[None, None]


def test_documents_are_read_off_a_mask_causal_per_document():
    found = documents_of(_doc_mask((3, 1, 4)), window=None, batch=2)
    assert found.cu_seqlens.tolist() == [0, 3, 4, 8, 11, 12, 16] and found.max_seqlen == 4
    assert found.cu_seqlens.dtype == torch.int32
    windowed = _doc_mask((6, 2), window=3)
    assert documents_of(windowed, window=3, batch=1).cu_seqlens.tolist() == [0, 6, 8]
    assert documents_of(windowed, window=None, batch=1) is None  # a band is not full causal attention


@pytest.mark.parametrize("change", ["extra_seen", "hidden", "bias", "not_square", "padding"])
def test_any_other_mask_is_not_taken_for_documents(change):
    mask = _doc_mask((3, 4))
    if change == "extra_seen":
        mask = mask.clone()
        mask[0, 0, 5, 1] = True  # one query sees a key of the document before
    elif change == "hidden":
        mask = mask.clone()
        mask[0, 0, 6, 4] = False  # a key of its own document hidden
    elif change == "bias":
        mask = torch.where(mask, 0.5, torch.finfo(torch.float32).min)  # an additive bias, not only 0 / lowest
    elif change == "not_square":
        mask = mask[..., :-1]
    else:
        mask = mask.clone()
        mask[..., 0] = False  # padding on the left: the first token sees nothing
    assert documents_of(mask, window=None, batch=1) is None


def _masks_to_check() -> list[tuple[torch.Tensor, int | None]]:
    exact = _doc_mask((3, 1, 4, 6))
    extra = exact.clone()
    extra[0, 0, 13, 2] = True  # a query of the last document sees a key of the first
    hidden = exact.clone()
    hidden[0, 0, 12, 9] = False
    return [(exact, None), (extra, None), (hidden, None), (_doc_mask((6, 8), window=3), 3),
            (_doc_mask((6, 8)), 3)]


def test_mask_check_in_row_blocks_gives_the_same_verdict(monkeypatch):
    """The check reads the mask a block of query rows at a time; blocks of one row and of several rows that do not
    divide the length find what the whole mask at once finds."""
    import kernels_core._kinds._packed as packed

    whole = [documents_of(mask, window=window, batch=2) for mask, window in _masks_to_check()]
    assert [w is None for w in whole] == [False, True, True, False, True]
    for elements in (1, 3 * 14):  # one query row a block; three rows a block (14 tokens: a last block of two)
        monkeypatch.setattr(packed, "_CHECK_ELEMENTS", elements)
        for (mask, window), expected in zip(_masks_to_check(), whole, strict=True):
            found = documents_of(mask, window=window, batch=2)
            assert (found is None) == (expected is None)
            if found is not None:
                assert found.cu_seqlens.tolist() == expected.cu_seqlens.tolist()
                assert found.max_seqlen == expected.max_seqlen


def test_mask_check_builds_nothing_larger_than_the_mask():
    """No tensor of the check outgrows the boolean mask it reads (an [S, S] tensor of int64 distances would be
    8x its size: 8 GiB at 32,768 tokens a row)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel() * t.element_size())
            return out

    mask = _doc_mask((100, 300, 112))
    with Largest():
        assert documents_of(mask, window=None, batch=1) is not None
    assert 0 < Largest.largest <= mask.numel() * mask.element_size()


def _forms(lengths: tuple[int, ...]) -> dict[str, dict]:
    """Every form a packed batch reaches a model in (labels with -100 at document starts)."""
    from transformers import DataCollatorWithFlattening

    row = _packed(lengths)
    features = []
    start = 0
    for n in lengths:
        features.append({"input_ids": row["input_ids"][0, start:start + n].tolist()})
        start += n
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(features)
    # LLaMA-Factory's neat_packing: segment ids turned into a 4-D additive mask (0 seen, the dtype's lowest not).
    neat = dict(row)
    neat["attention_mask"] = torch.where(_doc_mask(lengths), 0.0, torch.finfo(torch.float32).min)
    return {"position_ids": row, "flattening_collator": dict(flat), "neat_packing": neat}


def _per_document_reference(model, lengths):
    """The loss of each document run alone, summed as one packed row's mean loss over its labelled tokens."""
    row = _packed(lengths)
    total, count, start = 0.0, 0, 0
    for n in lengths:
        ids = row["input_ids"][:, start:start + n]
        labels = row["labels"][:, start:start + n]
        logits = model(input_ids=ids).logits
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        total = total + torch.nn.functional.cross_entropy(logits[0], shifted[0], reduction="sum", ignore_index=-100)
        count += int((shifted != -100).sum())
        start += n
    return total / count


@pytest.mark.parametrize("form", ["position_ids", "flattening_collator", "neat_packing"])
def test_per_document_rows_match_eager_and_each_document_alone(pm, sdpa_calls, form):
    model = _model(use_cache=False)
    batch = _forms(DOCUMENTS)[form]
    eager_loss, eager_grads = _loss_and_grads(model, batch)
    with torch.no_grad():
        assert_close(eager_loss, _per_document_reference(model, DOCUMENTS), dtype=torch.float32)
    twin = _kernelized_copy(model, pm)
    bound = [e for e in kernels_core.get_report(twin).entries if e.kind == "packed_attention" and e.applied]
    assert len(bound) == model.config.num_hidden_layers
    sdpa_calls.clear()
    loss, grads = _loss_and_grads(twin, batch)
    assert sdpa_calls[:len(DOCUMENTS)] == list(DOCUMENTS)  # the kernel ran, one call per document
    assert_close(loss, eager_loss, dtype=torch.float32)
    for name, grad in eager_grads.items():
        assert_close(grads[name], grad, dtype=torch.float32)


def test_rows_that_attend_across_documents_stay_so(pm, sdpa_calls):
    """A cache (config use_cache=True) makes eager attend across documents: no mask reaches attention, the kernel
    never runs and the result is eager's."""
    model = _model(use_cache=True)
    batch = _forms(DOCUMENTS)["position_ids"]
    eager_loss, _ = _loss_and_grads(model, batch)
    twin = _kernelized_copy(model, pm)
    sdpa_calls.clear()
    loss, _ = _loss_and_grads(twin, batch)
    assert set(sdpa_calls) == {sum(DOCUMENTS)}  # transformers' own causal calls over the whole row
    assert_close(loss, eager_loss, dtype=torch.float32)


def test_padded_batches_go_to_sdpa(pm, sdpa_calls):
    model = _model(use_cache=False)
    ids = torch.randint(3, 100, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    eager = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    twin = _kernelized_copy(model, pm)
    sdpa_calls.clear()
    assert_close(twin(input_ids=ids, attention_mask=mask, labels=ids).loss, eager, dtype=torch.float32)
    assert not sdpa_calls  # the padding mask goes to sdpa whole


@pytest.mark.parametrize("family,overrides", [
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True, "max_window_layers": 0}),
    ("mistral", {"sliding_window": 4}),
    ("gemma3_text", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
], ids=["qwen3-layer-types", "mistral", "gemma3"])
def test_sliding_window_families(pm, sdpa_calls, family, overrides):
    model = _model(family, use_cache=False, **overrides)
    batch = _packed(DOCUMENTS)
    eager_loss, eager_grads = _loss_and_grads(model, batch)
    twin = _kernelized_copy(model, pm)
    sdpa_calls.clear()
    loss, grads = _loss_and_grads(twin, batch)
    assert sdpa_calls and set(sdpa_calls) <= set(DOCUMENTS)  # documents shorter than the window need no band mask
    assert_close(loss, eager_loss, dtype=torch.float32)
    for name, grad in eager_grads.items():
        assert_close(grads[name], grad, dtype=torch.float32)


def test_bfloat16(pm, sdpa_calls):
    model = _model(use_cache=False, dtype=torch.bfloat16)
    batch = _packed(DOCUMENTS)
    eager_loss, _ = _loss_and_grads(model, batch)
    twin = _kernelized_copy(model, pm)
    sdpa_calls.clear()
    loss, _ = _loss_and_grads(twin, batch)
    assert sdpa_calls[:len(DOCUMENTS)] == list(DOCUMENTS)
    assert_close(loss, eager_loss, dtype=torch.bfloat16)


@pytest.mark.parametrize("family,overrides", [
    ("qwen3", {}),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True, "max_window_layers": 0}),
], ids=["causal", "sliding-layers"])
def _recording_backend(graphs: list) -> object:
    """AOTAutograd run eagerly (no C++ toolchain needed), keeping each graph Dynamo traced."""
    def backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    return backend


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # Dynamo probing
@pytest.mark.parametrize("family,overrides", [
    ("qwen3", {}),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
               "use_sliding_window": True, "max_window_layers": 0}),
], ids=["causal", "sliding-layers"])
def test_compiled_rows_take_the_masked_kernel(pm, monkeypatch, family, overrides):
    """Under torch.compile the documents cannot be read off the mask: the ``masked`` variant takes the mask itself
    and computes what eager computes, per document. The trace of a forward shows FlexAttention in every layer
    (admitted on the CPU for this check: it has no FlexAttention backward there); training steps, where the CPU
    kernel hands the mask to SDPA, give eager's loss and gradients."""
    import copy

    from kernels_core._portable import _masked_attention

    model = _model(family, use_cache=False, **overrides)
    batch = _packed(DOCUMENTS)
    eager_loss, eager_grads = _loss_and_grads(model, batch)
    twin = copy.deepcopy(model)
    kernels_core.kernelize(twin, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=pm)
    bound = {e.kernel for e in kernels_core.get_report(twin).entries if e.kind == "packed_attention"}
    assert bound == {"any.packed_attention.flex"}
    torch._dynamo.reset()
    graphs: list = []
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(_masked_attention, "_FLEX_DEVICES", ("cuda", "cpu"))
        logits = torch.compile(twin, backend=_recording_backend(graphs))(**batch).logits
        assert_close(logits, model(**batch).logits, dtype=torch.float32)
    traced = "".join(str(graph.graph) for graph in graphs)
    # The kernel ran in every layer.
    assert traced.count("higher_order.flex_attention") == model.config.num_hidden_layers
    torch._dynamo.reset()
    loss, _ = _loss_and_grads(torch.compile(twin, backend=_recording_backend([])), batch)
    assert_close(loss, eager_loss, dtype=torch.float32)
    for name, parameter in twin.named_parameters():
        assert_close(parameter.grad, eager_grads[name], dtype=torch.float32)
    torch._dynamo.reset()


_HOST_READS = ("__bool__", "item", "tolist", "nonzero")


def _host_reads_from_kernels_core(model: torch.nn.Module, batch: dict[str, torch.Tensor], monkeypatch) -> int:
    """How many times one forward of ``model`` reads tensor values back to the host from kernels-core's code (on a
    GPU each is a wait for the queue the host built ahead)."""
    import sys

    count = 0

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            nonlocal count
            caller = sys._getframe(1).f_globals.get("__name__", "")
            count += caller.startswith("kernels_core")
            return original(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in _HOST_READS:
            patch.setattr(torch.Tensor, name, counting(name))
        model(**batch)
    return count


@pytest.mark.parametrize("layers", [2, 6])
def test_the_documents_are_read_to_the_host_once_a_forward_not_once_a_layer(pm, monkeypatch, layers):
    """Reading the documents off the mask waits for the GPU once a forward (transformers' own packed-sequence
    detection already waits once), whatever the depth: the verdict is kept on the mask every layer shares, and the
    offsets as Python ints on cu_seqlens, where the portable kernel (documents of several lengths) finds them."""
    model = _kernelized_copy(_model(use_cache=False, num_hidden_layers=layers), pm)
    assert "any.packed_attention.per_document" in kernels_core.get_report(model).summary()
    batch = _packed()  # documents of four lengths: the portable kernel's per-document calls need the offsets
    model(**batch)  # a first forward: lazy set-up may read what it needs once
    reads = _host_reads_from_kernels_core(model, batch, monkeypatch)
    # documents_of: where documents start (nonzero), then the verdict and the offsets in one copy (tolist). Before,
    # the portable kernel read the offsets again in every layer.
    assert reads == 2
