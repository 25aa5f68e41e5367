"""End to end: ``kernels_core.kernelize(model, device="npu")`` on tiny CPU-resident transformers models.

NPU behaviour here is verified against the reference emulation of torch_npu only, not on Ascend hardware: the
emulated operators run on CPU tensors, and ``device="npu"`` makes kernelize resolve kernels for the (simulated)
NPU backend. Each model family is checked for outputs and gradients against its own eager forward, for which
kernels were bound, for which torch_npu operators really ran, and for an exact restore by ``unkernelize``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from kernels_core import KernelsPluginManager
from kernels_core import Mode
from kernels_core import get_report
from kernels_core import kernelize
from kernels_core import unkernelize


COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)  # grouped_mm (eager reference) needs 16-byte strides

# family -> (config class, model class, extra config, kernels expected on every decoder layer, operators run)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 4, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 5}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
}
MOE_FAMILIES = {"qwen3_moe", "mixtral"}
GELU_FAMILIES = {"gemma", "gemma2", "gemma3_text"}  # GeGLU MLPs: npu_swiglu does not apply
SOFTCAP_FAMILIES = {"gemma2"}  # attention logit softcapping: npu_fusion_attention declines
NOT_PRE_NORM_FAMILIES = {"phi3"}  # residual dropout: no residual_rms_norm
# Eager attention hands the attention function additive float masks, SDPA boolean ones (or none): cover both.
EAGER_FAMILIES = {"gemma2", "mistral", "qwen3_moe"}


def _model(family, dtype=torch.float32):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager" if family in EAGER_FAMILIES else "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.normal_(0.0 if "gemma" in family else 1.0, 0.2)  # non-trivial (1 + w) and w weights
    return model.train()


def _batch(padded):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 11))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 8:] = 0  # right padding: every real query still sees a real key
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.fixture
def npu_plugins():
    """A fresh plugin manager holding only the core's built-in plugin and kernels-npu (from its entry point)."""
    return KernelsPluginManager(allow=("npu",))


def _expected_kernels(family):
    kinds = {"rms_norm": "npu.rms_norm.fused", "rotary_embedding": "npu.rotary_embedding.rotary_mul"}
    if family not in NOT_PRE_NORM_FAMILIES:
        kinds["residual_rms_norm"] = "npu.residual_rms_norm.rms_norm"
    if family not in SOFTCAP_FAMILIES:
        kinds["attention"] = "npu.attention.fusion"
    if family in MOE_FAMILIES:
        kinds["moe_experts"] = "npu.moe_experts.grouped_matmul"
    elif family not in GELU_FAMILIES:
        kinds["silu_gated_mlp"] = "npu.silu_gated_mlp.swiglu"
    return kinds


def _expected_ops(family):
    ops = {"npu_rms_norm", "npu_rotary_mul"}
    if family not in SOFTCAP_FAMILIES:
        ops.add("npu_fusion_attention")
    if family in MOE_FAMILIES:
        ops |= {"npu_moe_token_permute", "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_unpermute"}
    elif family not in GELU_FAMILIES:
        ops.add("npu_swiglu")
    return ops


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right_padded"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_emulated_npu_kernelize_matches_eager_and_unkernelize_restores(family, padded, npu_plugins, emulation):
    model = _model(family)
    batch = _batch(padded)
    ref_logits, ref_loss, ref_grads = _run(model, batch)

    kernelize(model, mode=Mode.TRAINING, device="npu", plugin_manager=npu_plugins)
    report = get_report(model)
    chosen = {}
    for entry in report.entries:
        if entry.kernel is not None:
            chosen.setdefault(entry.kind, set()).add(entry.kernel)
    for kind, kernel_id in _expected_kernels(family).items():
        assert chosen.get(kind) == {kernel_id}, f"{kind}: chose {chosen.get(kind)}; report: {report.entries}"
    if family in SOFTCAP_FAMILIES:
        declined = [e for e in report.entries if e.kind == "attention"]
        assert declined and all(e.kernel is None and "softcapping" in e.reason for e in declined)

    emulation.calls.clear()
    logits, loss, grads = _run(model, batch)
    assert _expected_ops(family) <= {name for name, _ in emulation.calls}
    # float32 end to end: the emulated operators only reorder float32 arithmetic, through two decoder layers.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-4, atol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    unkernelize(model)
    assert get_report(model) is None
    assert all("forward" not in module.__dict__ for module in model.modules())
    emulation.calls.clear()
    logits_after, loss_after, _ = _run(model, batch)
    assert emulation.calls == []
    assert torch.equal(logits_after, ref_logits) and torch.equal(loss_after, ref_loss)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_emulated_npu_kernelize_bfloat16_training(family, npu_plugins):
    model = _model(family, dtype=torch.bfloat16)
    batch = _batch(padded=True)
    ref_logits, ref_loss, ref_grads = _run(model, batch)
    kernelize(model, mode=Mode.TRAINING, device="npu", plugin_manager=npu_plugins)
    logits, loss, grads = _run(model, batch)
    # bf16 keeps 8 significant bits; two decoder layers of once-rounded (emulated) against step-wise rounded
    # (eager) arithmetic drift by a few bf16 ulps of values of order 1, hence 5e-2 on logits and the loss.
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=5e-2, atol=5e-2)
    for name, grad in grads.items():
        ref = ref_grads[name].float()
        # Relative to the gradient's scale: accumulated bf16 rounding, not elementwise ulps, dominates here.
        error = (grad.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)
        assert error < 0.1, f"{name}: relative error {error:.3f}"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mistral"])
def test_emulated_npu_inference_with_kv_cache_prefill_and_decode(family, npu_plugins, emulation):
    model = _model(family).eval()
    ids = _batch(padded=False)["input_ids"]

    def prefill_then_decode():
        with torch.no_grad():
            first = model(input_ids=ids[:, :6], use_cache=True)
            chunk = model(input_ids=ids[:, 6:9], past_key_values=first.past_key_values, use_cache=True)
            step = model(input_ids=ids[:, 9:10], past_key_values=chunk.past_key_values, use_cache=True)
        return first.logits, chunk.logits, step.logits

    expected = prefill_then_decode()
    kernelize(model, mode=Mode.INFERENCE, device="npu", plugin_manager=npu_plugins)
    emulation.calls.clear()
    actual = prefill_then_decode()
    # 3 new queries against 9 cached keys (bottom-right causal), then a single decoding query.
    q_lens = sorted({args["query"].shape[2 if args["input_layout"] == "BNSD" else 1]
                     for name, args in emulation.calls if name == "npu_fusion_attention"})
    assert q_lens == [1, 3, 6]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_emulated_npu_attention_dropout_only_in_training(npu_plugins, emulation):
    model = _model("llama")
    model.config.attention_dropout = 0.25
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    kernelize(model, mode=Mode.TRAINING, device="npu", plugin_manager=npu_plugins)
    batch = _batch(padded=False)
    model.train()
    emulation.calls.clear()
    model(**batch)
    assert {a["keep_prob"] for n, a in emulation.calls if n == "npu_fusion_attention"} == {0.75}
    model.eval()
    emulation.calls.clear()
    model(**batch)
    assert {a["keep_prob"] for n, a in emulation.calls if n == "npu_fusion_attention"} == {1.0}


def test_emulated_npu_kernelize_is_per_instance(npu_plugins, emulation):
    kernelized, untouched = _model("qwen3"), _model("qwen3")
    kernelize(kernelized, mode=Mode.TRAINING, device="npu", plugin_manager=npu_plugins)
    batch = _batch(padded=True)
    emulation.calls.clear()
    untouched(**batch)
    assert emulation.calls == []  # the same classes, the same config values: only the kernelized instance changed
    kernelized(**batch)
    assert emulation.calls


def test_emulated_npu_kernels_are_not_chosen_for_torch_compile(npu_plugins):
    model = _model("llama")
    kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="npu", plugin_manager=npu_plugins)
    entries = [e for e in get_report(model).entries
               if e.kind in ("rms_norm", "attention", "silu_gated_mlp") and not e.covered]
    assert entries and all(e.kernel is None and "torch.compile" in e.reason for e in entries)
