"""End to end through ``kernels_core.kernelize`` on an NVIDIA GPU, tiny configs of ten model families.

Models run in float32 so that differences come from the kernels, not from rounding: Liger's kernels compute in
float32 and agree with eager to ~1e-5 relative, except Triton matmuls (fused MoE) which use TF32 (10-bit
mantissa, ~1e-3 relative per product). Hence logits within 5e-3 and gradients within 2e-2 relative norm error,
and training losses within 2% of eager's over 20 AdamW steps.
"""

from __future__ import annotations

import copy

import pytest
import torch


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma": ("GemmaConfig", dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=16)),
    "phi3": ("Phi3Config", {}),
}


def _model(family):
    import transformers

    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda")
    with torch.no_grad():  # non-trivial norm weights, so offset/casting mistakes show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _applied(model):
    import kernels_core

    report = kernels_core.get_report(model)
    assert report is not None
    return {e.kind: e.kernel for e in report.entries if e.applied}


def _loss_kernel(model):
    """The causal-LM loss kernel applied; every family tested here has a standard causal-LM forward."""
    import kernels_core

    entries = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
    assert len(entries) == 1 and entries[0].applied, [(e.kernel, e.reason) for e in entries]
    return entries[0].kernel


def _batch(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, 257, (2, 37), device="cuda", generator=g)
    return ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_grads_and_training_track_eager(family):
    import kernels_core

    eager = _model(family)
    ours = kernels_core.kernelize(copy.deepcopy(eager), mode=kernels_core.Mode.TRAINING)
    applied = _applied(ours)
    assert applied.get("rms_norm", "").startswith("cuda."), applied
    if family != "phi3":  # residual dropout: no add + norm to fuse
        assert applied.get("residual_rms_norm", "").startswith("cuda."), applied
    assert _loss_kernel(ours).startswith("cuda."), _applied(ours)

    ids = _batch()
    loss_e = eager(input_ids=ids, labels=ids).loss
    loss_o = ours(input_ids=ids, labels=ids).loss
    assert abs(loss_o.item() - loss_e.item()) <= 1e-4 * abs(loss_e.item()) + 1e-5
    loss_e.backward()
    loss_o.backward()
    params_o = dict(ours.named_parameters())
    for name, p in eager.named_parameters():
        assert params_o[name].grad is not None, name
        assert _rel(params_o[name].grad, p.grad) < 2e-2, (name, _rel(params_o[name].grad, p.grad))

    eager.eval()
    ours.eval()
    with torch.no_grad():
        assert _rel(ours(input_ids=ids).logits, eager(input_ids=ids).logits) < 5e-3

    eager.train()
    ours.train()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    for step in range(20):
        ids = _batch(step + 1)
        for model, opt in ((eager, opt_e), (ours, opt_o)):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            if model is eager:
                le = loss.item()
            else:
                lo = loss.item()
        assert abs(lo - le) <= 2e-2 * le, (step, lo, le)

    kernels_core.unkernelize(ours)
    assert kernels_core.get_report(ours) is None
    assert "forward" not in ours.model.norm.__dict__


# Both compile-capable families of the elementwise and norm kinds: kernels-triton's kernels as custom ops (the
# default under compile where priorities pick them) and the native ops Inductor fuses (chosen by configuration).
_NATIVE_UNDER_COMPILE = {kind: {"prefer": {"cuda": [f"cuda.{kind}.torch"]}}
                         for kind in ("rms_norm", "rotary_embedding", "silu_gated_mlp", "gelu_gated_mlp",
                                      "residual_rms_norm")}


@pytest.mark.parametrize("kernels", ["default", "native"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "inference"])
def test_torch_compile_fullgraph_on_kernelized_model(family, training, kernels):
    import kernels_core
    from kernels_cuda import cuda_kernel_specs

    torch._dynamo.reset()
    eager = _model(family)
    mode = (kernels_core.Mode.TRAINING if training else kernels_core.Mode.INFERENCE) | kernels_core.Mode.TORCH_COMPILE
    config = {"kinds": _NATIVE_UNDER_COMPILE} if kernels == "native" else None
    ours = kernels_core.kernelize(copy.deepcopy(eager), mode=mode, config=config)
    compile_safe = [s for s in cuda_kernel_specs()
                    if s.kind == "rms_norm" and s.supports & kernels_core.Supports.TORCH_COMPILE]
    best = max(compile_safe, key=lambda s: s.priority)
    expected = "cuda.rms_norm.torch" if kernels == "native" else best.id
    # Gemma 2's sandwich-norm layers fuse the residual add with pre_feedforward_layernorm.
    fused = f"cuda.residual_rms_norm.{'torch' if kernels == 'native' else 'tuned'}"
    if not training and kernels == "default":
        # Traced for inference these kernels are the plain math: the modules keep their own forward (no guards).
        assert best.left_to_compiler(mode)
        left = {e.kind for e in kernels_core.get_report(ours).entries
                if (e.left_to_compiler or "").startswith("cuda.") and e.reason.startswith("left to torch.compile")}
        assert {"rms_norm", "rotary_embedding"} <= left, left
        expected = fused = None
    assert _applied(ours).get("rms_norm") == expected
    assert _applied(ours).get("residual_rms_norm") == fused
    compiled = torch.compile(ours, fullgraph=True)
    ids = _batch()
    if training:
        assert _loss_kernel(ours) == "cuda.causal_lm_loss.liger"
        loss_e = eager(input_ids=ids, labels=ids).loss
        loss_o = compiled(input_ids=ids, labels=ids).loss
        assert abs(loss_o.item() - loss_e.item()) <= 1e-3 * abs(loss_e.item())
        loss_e.backward()
        loss_o.backward()
        params_o = dict(ours.named_parameters())
        for name, p in eager.named_parameters():
            assert _rel(params_o[name].grad, p.grad) < 2e-2, name
    else:
        eager.eval()
        ours.eval()
        with torch.no_grad():
            assert _rel(compiled(input_ids=ids).logits, eager(input_ids=ids).logits) < 5e-3
