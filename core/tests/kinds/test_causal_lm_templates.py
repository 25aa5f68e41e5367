"""The causal-LM matcher binds wherever the logits are lm_head(h) up to a scale, divisor or soft-cap, whatever the
forward's spelling or output class, and declines post-processing the fused kernel cannot reproduce, saying what."""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager
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
    """Logits times a configuration value, an extra output field: the kernel takes the scale."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :]) * self.config.logit_multiplier
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class BiasedLlamaForCausalLM(ScaledLlamaForCausalLM):
    """Logits plus a per-token offset: post-processing no kernel parameter reproduces."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states) + hidden_states[..., :1]
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class ExtraTermLlamaForCausalLM(ScaledLlamaForCausalLM):
    """The logits are lm_head's, but the loss adds a z-loss term: the fused loss would drop it."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            loss = loss + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()
        return CausalLMOutputWithPast(loss=loss, logits=logits)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("multiplier", [0.0625, 0.3])
@pytest.mark.parametrize("plugin", ["reference", "portable"])
def test_scaled_logits_fuse_with_the_scale_and_match_eager(ref_pm, calls, dtype, multiplier, plugin):
    # 1/16 is exact in every dtype (Command-R's value); 0.3 is not, and eager rounds the scaled bf16 logits. The
    # reference and portable kernels scale in the logits' dtype before the upcast, as eager does, so the loss is
    # float32 sums of identically rounded logits: float32's bound in every dtype. The gradients' bf16 GEMMs round
    # in another order (the portable kernel's chunks): the dtype's bound, twice for the layers behind the head.
    model = tiny_causal_lm("llama", dtype=dtype)
    model.config.logit_multiplier = multiplier
    model = _as(ScaledLlamaForCausalLM, model)
    ids = torch.randint(3, 100, (2, 9))
    eager = model(input_ids=ids, labels=ids)
    eager.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm if plugin == "reference" else
                           fresh_plugin_manager())
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert entry.kernel == ("ref.causal_lm_loss" if plugin == "reference" else "any.causal_lm_loss.chunked"), entry
    assert entry.variant == "scaled", entry.reason
    calls.clear()
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and calls["causal_lm_loss"] == (plugin == "reference")
    out.loss.backward()
    assert_close(out.loss, eager.loss, dtype=torch.float32)
    for name, param in model.named_parameters():
        assert_close(param.grad, grads[name], dtype=dtype, factor=2.0, what=name)


@pytest.mark.parametrize(("cls", "why"), [(BiasedLlamaForCausalLM, "post-processed"),
                                          (ExtraTermLlamaForCausalLM, "extra term")])
def test_what_the_kernel_cannot_reproduce_is_left_alone_with_what_differs(ref_pm, cls, why):
    model = _as(cls, tiny_causal_lm("llama"))
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert entry.kernel is None and why in entry.reason, entry.reason


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
