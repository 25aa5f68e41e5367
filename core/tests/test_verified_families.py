"""A family kernels-core is verified on whose code a matcher cannot read any more is warned about once.

The drift is simulated by giving a transformers class a forward of another shape (what a transformers release that
reshapes it looks like to the matchers); families kernels-core is not verified on, and test-defined classes, decline
the same way without a warning.
"""

from __future__ import annotations

import functools
import warnings

import kernels_core
import pytest
import torch
from kernels_core import KernelFallbackWarning
from kernels_core import Mode
from kernels_core._verified_families import VERIFIED
from kernels_core._verified_families import family
from kernels_core.testing import FAMILIES
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaForCausalLM  # noqa: E402


def _scaled_forward(self, input_ids=None, labels=None, **kwargs):
    """A causal-LM forward whose logits are clamped before the loss: no scale the fused kernel takes."""
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    logits = self.lm_head(hidden).clamp(max=self.config.logit_multiplier)
    loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                         vocab_size=self.config.vocab_size)
    return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _Opaque:
    """A decorator holding the function it wraps in an object, not in a closure cell: it cannot be re-created."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, instance, owner):
        return self if instance is None else functools.partial(self.fn, instance)


def _kernelize_recording(model, pm, mode):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels_core.kernelize(model, mode=mode, plugin_manager=pm)
    return [w for w in caught if issubclass(w.category, KernelFallbackWarning)]


def test_every_family_in_the_table_is_one_the_family_tests_build():
    folders = {name.removesuffix("_text") for name in FAMILIES}
    assert set().union(*VERIFIED.values()) <= folders
    assert family(LlamaForCausalLM) == "llama" and family(torch.nn.Linear) is None


def test_an_unreadable_causal_lm_forward_of_a_verified_family_warns_once(pm, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "forward", _scaled_forward)
    model = tiny_causal_lm("llama")
    model.config.logit_multiplier = 0.02
    caught = _kernelize_recording(model, pm, Mode.TRAINING)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "LlamaForCausalLM" in message and "causal_lm_loss" in message and transformers.__version__ in message
    assert "post-processed" in message
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert entry.kernel is None and "post-processed" in entry.reason
    again = tiny_causal_lm("llama")
    again.config.logit_multiplier = 0.02
    assert _kernelize_recording(again, pm, Mode.TRAINING) == [], "once per class and reason"


def test_an_unrecreatable_decoder_decorator_warns_once_for_all_layers(pm, monkeypatch):
    monkeypatch.setattr(LlamaDecoderLayer, "forward", _Opaque(LlamaDecoderLayer.forward))
    model = tiny_causal_lm("llama")
    caught = _kernelize_recording(model, pm, Mode.INFERENCE)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "LlamaDecoderLayer" in str(caught[0].message) and "residual_rms_norm" in str(caught[0].message)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "residual_rms_norm"]
    assert len(rows) == model.config.num_hidden_layers and all(e.kernel is None for e in rows)


def test_declines_by_design_and_outside_the_verified_families_stay_quiet(pm):
    # EXAONE-4's post-norm layers: no norm follows a residual add, declined on every transformers version by design.
    model = tiny_causal_lm("exaone4")
    assert _kernelize_recording(model, pm, Mode.TRAINING) == []
    entries = kernels_core.get_report(model).entries
    assert any(e.kind == "residual_rms_norm" and "post-norm" in e.reason for e in entries)

    class ScaledLlama(LlamaForCausalLM):  # a user's subclass: not transformers' code, so not verified
        forward = _scaled_forward

    model = tiny_causal_lm("llama")
    model.config.logit_multiplier = 0.02
    model.__class__ = ScaledLlama
    assert _kernelize_recording(model, pm, Mode.TRAINING) == []
