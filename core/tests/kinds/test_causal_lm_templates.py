"""The causal-LM matcher recognises transformers' forward templates across versions, and nothing else."""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaForCausalLM  # noqa: E402


class OlderLlamaForCausalLM(LlamaForCausalLM):
    """The forward as transformers <= 5.20 wrote it: inline slice, cache_position before logits_to_keep."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             cache_position=cache_position, **kwargs)
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class ScaledLlamaForCausalLM(OlderLlamaForCausalLM):
    """Same shape, but logits are post-processed: must be left alone."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :]) * self.config.logit_multiplier
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _as(cls, model):
    model.__class__ = cls
    return model


def test_older_template_is_fused_and_matches_eager(ref_pm, calls):
    model = _as(OlderLlamaForCausalLM, tiny_causal_lm("llama"))
    ids = torch.randint(3, 100, (2, 9))
    eager = model(input_ids=ids, labels=ids)
    eager.loss.backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert entry.kernel == "ref.causal_lm_loss", entry.reason
    calls.clear()
    out = model(input_ids=ids, labels=ids)
    assert calls["causal_lm_loss"] == 1 and out.logits is None
    out.loss.backward()
    assert_close(out.loss, eager.loss)
    assert_close(model.lm_head.weight.grad, grad)


def test_post_processed_logits_are_left_alone(ref_pm):
    model = tiny_causal_lm("llama")
    model.config.logit_multiplier = 2.0
    model = _as(ScaledLlamaForCausalLM, model)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert entry.kernel is None and "not a standard causal-LM template" in entry.reason


def test_fused_forward_takes_arguments_as_the_template_does(ref_pm, calls):
    """Positional arguments and the cache keyword of either spelling reach the fused path as the template's would."""
    from kernels_core._kinds._context import cache_keyword

    model = tiny_causal_lm("llama")
    ids = torch.randint(3, 100, (2, 9))
    eager_loss = model(input_ids=ids, labels=ids).loss
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    cache = cache_keyword(type(model).forward)
    calls.clear()
    # input_ids, attention_mask, position_ids, cache, inputs_embeds, labels: positionally.
    positional = model(ids, None, None, None, None, ids)
    assert calls["causal_lm_loss"] == 1 and positional.logits is None
    assert_close(positional.loss, eager_loss)
    for keyword in {cache, "past_key_values"}:  # the old spelling, where transformers still takes it
        asked = model(input_ids=ids, labels=ids, use_cache=True, **{keyword: None})
        assert asked.logits is None and getattr(asked, cache).get_seq_length() == ids.shape[1]
    assert calls["causal_lm_loss"] == 1 + len({cache, "past_key_values"})
    with pytest.raises(TypeError):
        model(ids, input_ids=ids, labels=ids)
