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
