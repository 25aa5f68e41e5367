"""PEFT LoRA, DoRA, modules_to_save and QLoRA with kernels-core: the same loss and adapter gradients as without it.

Every case trains one step from the same seed twice, float32 on the CPU: the plain PEFT model and the same model
kernelized either before ``get_peft_model`` (the kernels were bound to the bare model, and the fused forwards
must notice the wrappers at call time) or after it. Losses and the gradient of every trainable parameter must
agree to ``tolerance(float32)`` (2e-5 relative to the largest entry): both sides compute the same float32 math
and differ only in summation order (a chunked log-sum-exp, one matmul over ``[W | B]`` instead of two). LoRA
weights start random (``init_lora_weights=False``), so ``A``'s gradient is not trivially zero, and LoRA dropout is
on, with the same seed before each forward: the fused paths must draw the same masks in the same order.

The core's kinds that read a child's parameters without calling it are the causal-LM loss (``lm_head``) and the
residual add + RMSNorm (``post_attention_layernorm``); a wrapper they cannot reproduce must make them decline
(kernelize after PEFT, reason in the report) or fall back with one ``KernelFallbackWarning`` (kernelize before).
"""

from __future__ import annotations

import copy
import warnings

import kernels_core
import pytest
import torch
from kernels_core import KernelFallbackWarning
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


peft = pytest.importorskip("peft", reason="PEFT is an optional extra (kernels-core[peft])")
pytest.importorskip("transformers")

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"all-linear": "all-linear", "lm_head": ["lm_head"], "all-linear+lm_head": [*LINEARS, "lm_head"]}
ORDERS = ("kernelize_first", "peft_first")


def _ids(vocab: int = 101) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # an unlabelled prompt, as SFT data has
    return ids, labels


def _peft(model, config, seed=7):
    torch.manual_seed(seed)  # the same random LoRA weights on both sides
    with warnings.catch_warnings():
        # LoRA on a head tied to the embeddings: PEFT suggests ensure_weight_tying; both sides train it the same.
        warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`", UserWarning)
        return peft.get_peft_model(model, copy.deepcopy(config))


def _step(model, ids, labels):
    """One forward and backward: (loss, logits, {trainable parameter name: gradient})."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the same LoRA dropout masks
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits, grads


def _kernelized(base, config, order, plugin_manager):
    """(the PEFT model, the model kernelize ran on) for one order."""
    if order == "kernelize_first":
        kernels_core.kernelize(base, mode=Mode.TRAINING, plugin_manager=plugin_manager)
        return _peft(base, config), base
    model = _peft(base, config)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=plugin_manager)
    return model, model


def _assert_same(got, expected):
    loss, _, grads = got
    ref_loss, _, ref_grads = expected
    assert_close(loss, ref_loss, what="loss")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None, name
        assert grads[name] is not None, f"{name} got no gradient: the kernels bypassed it"
        assert_close(grads[name], ref, what=name)


def _entry(model, kind, suffix=""):
    return next(e for e in kernels_core.get_report(model).entries if e.kind == kind and e.module.endswith(suffix))


def _compare(family, config, order, plugin_manager, **overrides):
    base = tiny_causal_lm(family, **overrides)
    expected = _step(_peft(copy.deepcopy(base), config), *_ids())
    model, kernelized = _kernelized(base, config, order, plugin_manager)
    got = _step(model, *_ids())
    _assert_same(got, expected)
    return model, kernelized, got


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("targets", sorted(TARGETS))
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lora_matches_plain_peft(family, targets, order, pm):
    """LoRA on every linear layer, on lm_head, or both; the loss stays fused and trains the lm_head adapter."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[targets],
                             init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        model, kernelized, (_, logits, grads) = _compare(family, config, order, pm)
    assert logits is None, "the fused loss did not run"
    entry = _entry(kernelized, "causal_lm_loss")
    assert entry.kernel == "any.causal_lm_loss.chunked", entry.reason
    assert _entry(kernelized, "silu_gated_mlp").kernel and _entry(kernelized, "residual_rms_norm").kernel
    head = [n for n in grads if "lm_head.lora_" in n]
    assert len(head) == (2 if "lm_head" in targets else 0)
    assert all(grads[n].abs().max() > 0 for n in head)


def test_adapter_switches_after_kernelize_are_followed(pm):
    """Two LoRA adapters on lm_head, switched and disabled between steps: each step uses the active ones."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    base = tiny_causal_lm("qwen3")
    plain = _peft(copy.deepcopy(base), config)
    plain.add_adapter("second", copy.deepcopy(config))
    kernels_core.kernelize(base, mode=Mode.TRAINING, plugin_manager=pm)
    model = _peft(base, config)
    model.add_adapter("second", copy.deepcopy(config))
    model.load_state_dict(plain.state_dict())
    for adapter in ("second", "default"):
        plain.set_adapter(adapter)
        model.set_adapter(adapter)
        _assert_same(_step(model, *_ids()), _step(plain, *_ids()))
    with plain.disable_adapter(), model.disable_adapter():  # nothing trains: the loss only
        expected = plain(input_ids=_ids()[0], labels=_ids()[1]).loss
        out = model(input_ids=_ids()[0], labels=_ids()[1])
        assert out.logits is None
        assert_close(out.loss, expected)


@pytest.mark.parametrize("order", ORDERS)
def test_modules_to_save_lm_head_trains_the_copy(order, pm):
    """modules_to_save=["lm_head"] trains a copy of the head: the fused loss reads the copy the wrapper runs."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, modules_to_save=["lm_head"],
                             init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        _, kernelized, (_, logits, grads) = _compare("qwen3", config, order, pm, tie_word_embeddings=False)
    assert logits is None and _entry(kernelized, "causal_lm_loss").kernel
    assert any("lm_head.modules_to_save" in n for n in grads)


@pytest.mark.parametrize("variant", ["use_dora", "lora_bias"])
@pytest.mark.parametrize("order", ORDERS)
def test_head_adapters_the_fused_loss_cannot_fold(variant, order, pm):
    """DoRA and lora_bias on lm_head: declined with the reason, or one warning and the model's own forward."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False,
                             **{variant: True})
    reason = "DoRA" if variant == "use_dora" else "lora_bias"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, kernelized, (_, logits, _) = _compare("qwen3", config, order, pm)
        _step(model, *_ids())  # a second step warns no more
    fallbacks = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    assert logits is not None, "the model's own forward should have run"
    entry = _entry(kernelized, "causal_lm_loss")
    if order == "peft_first":
        assert entry.kernel is None and reason in entry.reason, entry.reason
        assert not fallbacks
    else:
        # Bound before PEFT wrapped the head: the call-time check falls back, and the report says so.
        assert entry.kernel is None and entry.fell_back is not None and reason in entry.reason, entry
        assert len(fallbacks) == 1 and reason in str(fallbacks[0].message), [str(w.message) for w in fallbacks]


@pytest.mark.parametrize("order", ORDERS)
def test_modules_to_save_norm_is_never_bypassed(order, pm):
    """A norm the fused residual add + RMSNorm reads, wrapped by modules_to_save: its trainable copy is trained."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False,
                             modules_to_save=["post_attention_layernorm", "norm"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        _, kernelized, (_, _, grads) = _compare("qwen3", config, order, pm)
    copies = [n for n in grads if "post_attention_layernorm.modules_to_save" in n]
    assert len(copies) == 2 and all(grads[n].abs().max() > 0 for n in copies)
    entry = _entry(kernelized, "residual_rms_norm", "layers.0")
    if order == "peft_first":
        assert entry.kernel is None and "ModulesToSaveWrapper" in entry.reason, entry.reason
    else:
        assert entry.kernel is not None


def test_norm_replaced_after_kernelize_falls_back_once(pm):
    """An unknown replacement of post_attention_layernorm after kernelize: the layer runs its own forward."""

    class ScaledNorm(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm, self.weight = norm, torch.nn.Parameter(torch.full_like(norm.weight, 2.0))

        def forward(self, x):
            return self.norm(x) * self.weight

    model = tiny_causal_lm("qwen3")
    plain = copy.deepcopy(model)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    for m in (model, plain):
        for layer in m.model.layers:
            layer.post_attention_layernorm = ScaledNorm(layer.post_attention_layernorm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_same(_step(model, *_ids()), _step(plain, *_ids()))
        _step(model, *_ids())
    messages = [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)]
    assert len(messages) == len(model.model.layers) and all("is now ScaledNorm" in m for m in messages), messages


FAMILY_SETTINGS = {
    # Sliding and full attention layers, tied embeddings (LoRA on a tied head), offset norms, GeGLU.
    "gemma3_text": {"num_hidden_layers": 3, "sliding_window": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "qwen3_moe": {},
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", sorted(FAMILY_SETTINGS))
def test_every_kind_with_lora(family, order, ref_pm, calls):
    """The reference plugin binds every core kind (rotary, experts, offset norms...), the portable one sliding-window
    attention. On Qwen3-MoE LoRA also adapts the experts' 3-D weights (target_parameters), which the experts
    kernel reads: PEFT swaps in the adapted weights only while its wrapper runs the experts' forward."""
    moe = family == "qwen3_moe"
    targets = [*LINEARS[:4], "lm_head"] if moe else [*LINEARS, "lm_head"]
    experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if moe else {}
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0 if moe else 0.1, target_modules=targets,
                             init_lora_weights=False, **experts)  # PEFT allows no dropout on 3-D parameters
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        _, kernelized, (_, logits, grads) = _compare(family, config, order, ref_pm, **FAMILY_SETTINGS[family])
    assert logits is None and _entry(kernelized, "causal_lm_loss").kernel == "ref.causal_lm_loss"
    kinds = {"causal_lm_loss", "rotary_embedding", "rms_norm"} | ({"moe_experts"} if moe else {"gelu_gated_mlp"})
    assert kinds <= set(calls), calls
    if moe:
        assert any("experts" in n and "lora_" in n for n in grads)
    else:
        assert _entry(kernelized, "sliding_window_attention", "layers.0.self_attn").kernel


def test_quantized_head_is_declined_or_falls_back(pm):
    """An lm_head whose forward is not F.linear over its .weight (bitsandbytes Linear4bit, packed weights)."""

    class PackedLinear(torch.nn.Linear):  # what a quantized linear looks like to the matcher
        def forward(self, x):
            return super().forward(x) * 1.5

    model = tiny_causal_lm("qwen3", tie_word_embeddings=False)
    head = PackedLinear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    declined = copy.deepcopy(model)
    declined.lm_head = copy.deepcopy(head)
    kernels_core.kernelize(declined, mode=Mode.TRAINING, plugin_manager=pm)
    entry = _entry(declined, "causal_lm_loss")
    assert entry.kernel is None and "PackedLinear, a linear layer with its own forward" in entry.reason

    plain = copy.deepcopy(declined)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    model.lm_head = head
    with pytest.warns(KernelFallbackWarning, match="PackedLinear"):
        got = _step(model, *_ids())
    _assert_same(got, _step(plain, *_ids()))


def _bnb_or_skip():
    return pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (kernels-core[qlora])")


@pytest.fixture(scope="module")
def saved_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-qlora")
    tiny_causal_lm("qwen3", hidden_size=64, intermediate_size=96, head_dim=16, tie_word_embeddings=False
                   ).save_pretrained(path)
    return str(path)


def _load_4bit(path, storage=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    from transformers import BitsAndBytesConfig

    # nf4 with a floating-point quant storage (what FSDP needs to shard the packed weights) or bitsandbytes'
    # default uint8; compute in float32 so that the comparison is float32 on both sides.
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32,
                                                     device_map="cpu")
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("targets", "storage"), [
    ("all-linear", "bfloat16"), ("all-linear+lm_head", "bfloat16"), ("all-linear", "uint8")])
def test_qlora_matches_plain_qlora(targets, storage, order, saved_qwen3, pm):
    """QLoRA: 4-bit nf4 base layers, LoRA on top; the gated MLP kernel calls the 4-bit projections, the fused loss
    takes the (unquantized) head with its adapter. On an AVX512-BF16 CPU an eval-mode forward of a 4-bit layer
    repacks its weight for inference, after which its backward is wrong: kernelize's probes must not cause that."""
    bnb = _bnb_or_skip()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS[targets],
                             init_lora_weights=False)
    expected = _step(_peft(_load_4bit(saved_qwen3, getattr(torch, storage)), config), *_ids())
    base = _load_4bit(saved_qwen3, getattr(torch, storage))
    assert isinstance(base.model.layers[0].mlp.gate_proj, bnb.nn.Linear4bit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        model, kernelized = _kernelized(base, config, order, pm)
        got = _step(model, *_ids())
    _assert_same(got, expected)
    assert got[1] is None and _entry(kernelized, "causal_lm_loss").kernel
    assert _entry(kernelized, "silu_gated_mlp").kernel, _entry(kernelized, "silu_gated_mlp").reason


def test_4bit_head_is_declined(saved_qwen3, pm):
    """A 4-bit lm_head (Linear4bit, packed Params4bit weight): reading .weight would be wrong, so no fused loss."""
    bnb = _bnb_or_skip()
    model = _load_4bit(saved_qwen3)
    head = bnb.nn.Linear4bit(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                             compute_dtype=torch.float32, quant_type="nf4", quant_storage=torch.bfloat16)
    head.weight = bnb.nn.Params4bit(model.lm_head.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                    quant_storage=torch.bfloat16)
    model.lm_head = head.to("cpu")
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    entry = _entry(model, "causal_lm_loss")
    assert entry.kernel is None and "Linear4bit" in entry.reason, entry.reason


def test_lora_head_compiles_without_graph_breaks(pm):
    """The call-time look at lm_head (plain, or PEFT's LoRA layer) traces: torch.compile(fullgraph=True) of the
    model kernelized before get_peft_model, and the same loss and gradients as plain PEFT."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    base = tiny_causal_lm("qwen3")
    expected = _step(_peft(copy.deepcopy(base), config), *_ids())
    kernels_core.kernelize(base, mode=Mode.TRAINING | Mode.TORCH_COMPILE, plugin_manager=pm)
    model = _peft(base, config)
    compiled = torch.compile(model.base_model.model, fullgraph=True, backend="aot_eager")
    model.train()
    out = compiled(input_ids=_ids()[0], labels=_ids()[1])
    out.loss.backward()
    assert out.logits is None
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    _assert_same((out.loss.detach(), None, grads), expected)
