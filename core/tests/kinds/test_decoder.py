"""The ``residual_rms_norm`` kind: pre-norm decoder layers matched by their math, and the fused forward exact.

The reference plugin's kernel is the reference math, so a kernelized model must reproduce eager outputs and
gradients to rounding; the portable kernel runs the eager ops themselves. Families whose layers do something else
around the residual adds must be left alone with the reason in the report.
"""

from __future__ import annotations

import copy
import functools
import re

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")

KIND = "residual_rms_norm"
LAYER = re.compile(r"model\.layers\.\d+")

# Llama-style pre-norm layers: (family, variant of the fused norm).
PRE_NORM = {"llama": "standard", "mistral": "standard", "qwen2": "standard", "qwen3": "standard",
            "qwen3_moe": "standard", "mixtral": "standard", "gemma": "offset",
            # Gemma 2/3's sandwich norms (the add fused with pre_feedforward_layernorm), Granite's multiplier.
            "gemma2": "offset", "gemma3_text": "offset", "granite": "standard",
            # GLM-4's sandwich: the add fused with post_attention_layernorm, between post_self_attn / post_mlp norms.
            "glm4": "standard",
            # Phi-3's dropout on each residual branch, gpt-oss's MLP returning (hidden states, router scores),
            # VaultGemma's norm named for the MLP, Granite-MoE-Shared's shared experts beside the routed ones.
            "phi3": "standard", "gpt_oss": "standard", "vaultgemma": "offset", "granitemoeshared": "standard",
            # HyperCLOVA X: a norm on each branch's output (peri-layer norm) and a residual multiplier; Apertus:
            # the template's norms named attention_layernorm / feedforward_layernorm.
            "hyperclovax": "standard", "apertus": "standard"}
# Settings that make a multiplier, norm or dropout visible in the numbers (a default of 1.0 or 0.0 would hide a
# missing one).
OVERRIDES = {"granite": {"residual_multiplier": 0.22, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
                         "logits_scaling": 8.0},
             "granitemoeshared": {"residual_multiplier": 0.22, "shared_intermediate_size": 40, "num_local_experts": 4,
                                  "num_experts_per_tok": 2},
             "phi3": {"resid_pdrop": 0.2},
             "hyperclovax": {"residual_multiplier": 0.3},
             "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["sliding_attention",
                                                                                          "full_attention"]}}

# Layers that do something else around the residual adds, and a fragment of the reason they are left alone with.
DECLINED = {
    "olmo2": "does not use ['input_layernorm']",
    "exaone4": "post-norm",
    "cohere": "parallel attention and MLP",
    "phi": "dropout on the residual branch",
    "starcoder2": "not an RMSNorm",
    "nemotron": "does not pass ['kwargs'] on",
}


def _model(family: str, **overrides):
    try:
        return tiny_causal_lm(family, **overrides)
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"{family} cannot be built from a tiny config with this transformers: {exc}")


def _rows(model):
    return [e for e in kernels_core.get_report(model).entries if e.kind == KIND]


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks for eager and kernelized runs
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(PRE_NORM))
def test_pre_norm_layers_are_matched_by_their_math(family, ref_pm):
    model = _model(family, **OVERRIDES.get(family, {}))
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    rows = _rows(model)
    assert sorted(e.module for e in rows) == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    for entry in rows:
        assert entry.variant == PRE_NORM[family], f"{entry.module}: {entry.variant}"
        assert entry.kernel == "ref.residual_rms_norm", f"{entry.module}: {entry.reason}"


@pytest.mark.parametrize("family", sorted(DECLINED))
def test_other_layer_layouts_are_left_alone_with_the_reason(family, ref_pm, calls):
    model = _model(family)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    rows = _rows(model)
    assert rows, f"{family}: its decoder layers should be reported as declined"
    for entry in rows:
        assert entry.kernel is None and DECLINED[family] in (entry.reason or ""), f"{family}: {entry.reason}"
    model(input_ids=torch.randint(3, 100, (1, 5)))
    assert calls[KIND] == 0


@pytest.mark.parametrize("plugin", ["reference", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma", "qwen3_moe", "gemma2", "gemma3_text",
                                    "granite", "glm4", "phi3", "gpt_oss", "vaultgemma", "granitemoeshared",
                                    "hyperclovax", "apertus"])
def test_fused_layers_match_eager_forward_and_backward(family, dtype, plugin, ref_pm, pm, calls):
    model = _model(family, dtype=dtype, **OVERRIDES.get(family, {}))
    ids = torch.randint(3, 100, (2, 11))
    model.eval()
    with torch.no_grad():
        eager_logits = model(input_ids=ids).logits
    model.train()
    eager_loss, eager_grads = _loss_and_grads(model, ids)

    manager = ref_pm if plugin == "reference" else pm
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=manager)
    expected_kernel = "ref.residual_rms_norm" if plugin == "reference" else "cpu.residual_rms_norm.recompute"
    assert {e.kernel for e in _rows(model)} == {expected_kernel}
    calls.clear()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert_close(logits, eager_logits, dtype=dtype, factor=2.0 if family == "qwen3_moe" else 1.0, what="logits")
    model.train()
    loss, grads = _loss_and_grads(model, ids)
    assert_close(loss, eager_loss, dtype=dtype, what="loss")
    assert grads.keys() == eager_grads.keys()
    if not (family == "qwen3_moe" and dtype == torch.bfloat16):  # near-tied routing flips in bf16 (test_families)
        for name, grad in grads.items():
            assert_close(grad, eager_grads[name], dtype=dtype, factor=2.0, what=f"grad {name}")
    if plugin == "reference":
        # One fused call per layer and forward (eval and training); the post-attention norms never run, and the
        # report lists them as covered, not as kernels of their own.
        layers = model.config.num_hidden_layers
        report = kernels_core.get_report(model)
        norms = sum(1 for e in report.applied if e.kind == "rms_norm")
        assert calls[KIND] == 2 * layers
        assert calls["rms_norm"] == 2 * norms, "every RMSNorm the report lists, twice"
        fused = ("pre_feedforward_layernorm" if family in ("gemma2", "gemma3_text", "vaultgemma")
                 else "feedforward_layernorm" if family == "apertus" else "post_attention_layernorm")
        assert sorted(e.module for e in report.covered) == [f"model.layers.{i}.{fused}" for i in range(layers)]


def test_gradient_checkpointing_still_recomputes_the_fused_layers(ref_pm, calls):
    model = _model("qwen3")
    ids = torch.randint(3, 100, (2, 9))
    model.train()
    eager_loss, eager_grads = _loss_and_grads(model, ids)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    # Enabled after kernelize: the re-created transformers wrapper reads the flag at call time. (transformers 5.2x
    # renamed the switch; older 5.x only has the gradient_checkpointing_* names.)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls.clear()
    loss, grads = _loss_and_grads(model, ids)
    assert calls[KIND] == 2 * model.config.num_hidden_layers, "each layer runs again in backward (checkpointed)"
    assert_close(loss, eager_loss, what="loss")
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name], factor=2.0, what=f"grad {name}")
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    calls.clear()
    _loss_and_grads(model, ids)
    assert calls[KIND] == model.config.num_hidden_layers


def test_generation_with_a_kv_cache_matches_eager(ref_pm, calls):
    model = _model("llama").eval()
    model.config.use_cache = True
    ids = torch.randint(3, 100, (1, 6))
    eager = model.generate(ids, max_new_tokens=6, do_sample=False)
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    calls.clear()
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), eager)
    assert calls[KIND] >= 6 * model.config.num_hidden_layers, "prefill and every decoding step"


@pytest.mark.parametrize("mode", [Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE],
                         ids=["inference", "training"])
def test_fused_layers_compile_with_fullgraph(ref_pm, calls, mode):
    torch._dynamo.reset()
    model = _model("llama")
    ids = torch.randint(3, 100, (2, 8))
    training = Mode.TRAINING in mode
    model.train(training)
    eager = model(input_ids=ids, labels=ids if training else None)
    kernels_core.kernelize(model, mode=mode, plugin_manager=ref_pm)
    calls.clear()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids if training else None)
    assert calls[KIND] == model.config.num_hidden_layers, "traced into the graph once per layer"
    if training:
        assert_close(out.loss, eager.loss, what="compiled loss")
        out.loss.backward()
        assert model.model.layers[0].post_attention_layernorm.weight.grad is not None
    else:
        assert_close(out.logits, eager.logits, what="compiled logits")


def test_probe_declines_a_template_lookalike_whose_math_differs(ref_pm):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class ScaledResidualLayer(LlamaDecoderLayer):
        # The template's names exactly, but the attention output is doubled before the residual add: only a
        # probe of the forward can tell.
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, past_key_values=past_key_values,
                                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + 2 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            return residual + hidden_states

    model = _model("llama")
    for layer in model.model.layers:
        layer.__class__ = ScaledResidualLayer
    ids = torch.randint(3, 100, (1, 7))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    rows = _rows(model)
    assert rows and all(e.kernel is None and "math differs" in e.reason for e in rows), rows
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits, eager, what="logits of the declined layers")


def _renaming(old: str, new: str):
    """A keyword-renaming decorator in the style of transformers' ``deprecate_kwarg``."""
    def decorate(fn):
        @functools.wraps(fn)
        def renamed(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return renamed
    return decorate


def test_decorators_around_the_layer_forward_are_kept_around_the_fused_one(ref_pm, calls):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class RenamingLayer(LlamaDecoderLayer):
        forward = _renaming("mask", "attention_mask")(LlamaDecoderLayer.forward)

    model = _model("llama")
    for layer in model.model.layers:
        layer.__class__ = RenamingLayer
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    positions = model.model.rotary_emb(hidden, torch.arange(5)[None])
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    mask[..., 1:, 0] = False  # not the causal pattern SDPA applies when no mask arrives
    with torch.no_grad():
        eager = layer(hidden, mask=mask, position_embeddings=positions)
        unmasked = layer(hidden, position_embeddings=positions)
    assert not torch.allclose(eager, unmasked), "the mask must matter, or the renaming is not tested"
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    assert {e.kernel for e in _rows(model)} == {"ref.residual_rms_norm"}, _rows(model)
    calls.clear()
    with torch.no_grad():
        fused = layer(hidden, mask=mask, position_embeddings=positions)
    assert calls[KIND] == 1
    assert_close(fused, eager, what="fused layer called with the renamed keyword")


def test_attention_dropout_is_matched_with_identical_random_streams(ref_pm):
    # Dropout inside the layer's own sub-modules is the layer's math; the probe compares both forwards under the
    # same random stream, and leaves the caller's stream where it was.
    model = _model("llama", attention_dropout=0.5)
    ids = torch.randint(3, 100, (2, 9))
    model.train()
    eager_loss, _ = _loss_and_grads(model, ids)
    state = torch.get_rng_state()
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert torch.equal(torch.get_rng_state(), state), "kernelize must not move the global random stream"
    assert {e.kernel for e in _rows(model)} == {"ref.residual_rms_norm"}
    loss, _ = _loss_and_grads(model, ids)
    assert_close(loss, eager_loss, what="loss with attention dropout")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_probe_compares_training_behaviour_with_live_dropout_masks(ref_pm, attention):
    # A lookalike that averages two attention calls equals the template in eval behaviour; with dropout the two
    # calls draw different masks, so only a training probe with live (not disabled) dropout can tell. SDPA takes
    # the dropout inside the call, eager attention through F.dropout: the probe draws both from its own generator.
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class TwiceAttendingLayer(LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            first, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            second, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                       position_ids=position_ids, past_key_values=past_key_values,
                                       use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
            hidden_states = residual + (first + second) / 2
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            return residual + hidden_states

    model = _model("llama", attention_dropout=0.5, attn_implementation=attention)
    for layer in model.model.layers:
        layer.__class__ = TwiceAttendingLayer
    state = torch.get_rng_state()
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert torch.equal(torch.get_rng_state(), state), "kernelize must not move the global random stream"
    rows = _rows(model)
    assert rows and all(e.kernel is None and "math differs" in e.reason for e in rows), rows
    # The same layers without dropout are indistinguishable from the template: the decline above is the masks'.
    quiet = _model("llama", attention_dropout=0.0, attn_implementation=attention)
    for layer in quiet.model.layers:
        layer.__class__ = TwiceAttendingLayer
    kernels_core.kernelize(quiet, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert {e.kernel for e in _rows(quiet)} == {"ref.residual_rms_norm"}, _rows(quiet)


def test_hooked_norms_and_replaced_forwards_are_left_alone(ref_pm):
    model = _model("llama")
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda module, args, out: None)
    layer = model.model.layers[1]
    layer.forward = functools.partial(type(layer).forward, layer)  # an instance-level forward from other code
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    reasons = {e.module: e.reason for e in _rows(model)}
    assert "forward hooks" in reasons["model.layers.0"]
    assert "already replaced" in reasons["model.layers.1"]


def test_disabled_by_config_leaves_the_post_attention_norms_to_rms_norm(ref_pm, calls):
    model = _model("llama")
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm,
                           config={"kinds": {KIND: {"enabled": False}}})
    calls.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5)))
    assert calls[KIND] == 0 and calls["rms_norm"] == 2 * model.config.num_hidden_layers + 1


def test_copies_stay_fused_and_unkernelize_restores(ref_pm, calls):
    model = _model("qwen3")
    ids = torch.randint(3, 100, (1, 6))
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    clone = copy.deepcopy(model)
    calls.clear()
    with torch.no_grad():
        assert_close(clone(input_ids=ids).logits, eager, what="deep copy")
    assert calls[KIND] == clone.config.num_hidden_layers
    assert clone.model.layers[0].forward.__self__.module is clone.model.layers[0], "bound to the copy"
    kernels_core.unkernelize(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, eager)
