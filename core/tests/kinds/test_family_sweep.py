"""Every causal-LM family transformers ships that has an RMSNorm and a rotary embedding, kernelized on the CPU.

Each family is built from its configuration's own defaults, shrunk to two layers of width 64
(``tiny_family_causal_lm``), and kernelized for training with the reference plugin, whose kernels compute each
kind's reference math: the loss and every gradient must then equal eager's to float32 rounding, so a matcher that
bound a module whose math differs (a scale it dropped, a norm it skipped) fails here. A kind left alone must say
why. ``plugins-cuda/tests/test_family_coverage.py`` resolves the same families for a simulated H200.
"""

from __future__ import annotations

import warnings

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_family_causal_lm


transformers = pytest.importorskip("transformers")
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402


KINDS = ("causal_lm_loss", "residual_rms_norm", "rotary_embedding", "silu_gated_mlp", "rms_norm")
# The model types of transformers 5.24's causal-LM mapping whose tiny model (every kind of layer its configuration
# names) has an RMSNorm and a rotary embedding
# (``python -m tools.family_table`` finds them). Listed rather than found at run time: building every one of the
# mapping's ~200 model types in one process, the older architectures' defaults included, takes more memory than CI
# has; a type a newer transformers adds is covered by the docs table until it is listed here.
MODERN = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba", "beam",
    "bitnet", "cwm", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "diffllama", "doge", "emu3",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon_h1", "flex_olmo", "flint", "gemma",
    "gemma2", "gemma3", "gemma3_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "got_ocr2",
    "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hrm_text",
    "hy_v3", "hy_v4", "hyperclovax", "internlm3", "iquestcoder", "jetmoe", "kolibri1", "laguna", "lara_mini",
    "lfm2", "lfm3", "llama", "llama4", "llama4_text", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm3",
    "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral3", "mistral", "mixtral", "mllama", "moshi",
    "moss_transcribe_diarize", "nanochat", "olmo2", "olmo3", "olmo_hybrid", "olmoe", "phi3", "phi4_multimodal",
    "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
    "qwen3_next", "qwen4_exp", "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
    "vaultgemma", "youtu",
)


def _modern(model) -> bool:
    modules = list(model.modules())
    return (any("RMSNorm" in type(m).__name__ for m in modules)
            and any(name.endswith("inv_freq") for m in modules for name in m._buffers))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks in both runs, where a family trains with dropout
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _route_like_a_checkpoint(model) -> None:
    """Fill a hash router's frozen token-to-expert table (DeepSeek-V4's ``tid2eid``, zeros until a checkpoint loads
    it) with distinct experts per token. All zeros, every token picks expert 0 in every slot, the normalised routing
    weights are the constant 1/top_k and the gate's exact gradient is zero: what eager then returns is rounding noise
    (about 1e-10 here), which any reordering of the same sums (transformers' own batched_mm experts) changes
    completely, so comparing it would test nothing but the order of additions."""
    generator = torch.Generator().manual_seed(5)
    for module in model.modules():
        table = module._buffers.get("tid2eid")
        if table is not None:
            experts = module.num_experts
            rows = [torch.randperm(experts, generator=generator)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


@pytest.mark.parametrize("family", MODERN)
def test_family_loss_and_gradients_equal_eager(family, ref_pm, calls):
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {family}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = tiny_family_causal_lm(family)
        except Exception as exc:  # noqa: BLE001 - depends on the installed transformers
            pytest.skip(f"{family} cannot be built from a tiny config with this transformers: {exc}")
    if not _modern(model):
        pytest.skip(f"{family} has no RMSNorm and rotary embedding (not a modern decoder)")
    _route_like_a_checkpoint(model)
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (2, 9))
    model.train()
    try:
        eager_loss, eager_grads = _loss_and_grads(model, ids)
    except Exception as exc:  # noqa: BLE001 - the tiny defaults of some families do not train eagerly
        pytest.skip(f"{family}'s tiny model does not train eagerly: {type(exc).__name__}: {exc}")
    with warnings.catch_warnings():
        # A verified family's decline warns (the multimodal Gemma 3 hands labels to its base model); checked below.
        warnings.simplefilter("ignore")
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entries = [e for e in kernels_core.get_report(model).entries if e.kind in KINDS]
    for entry in entries:
        assert entry.kernel or entry.reason, f"{family} {entry.module}: {entry.kind} left alone without a reason"
    calls.clear()
    loss, grads = _loss_and_grads(model, ids)
    assert_close(loss, eager_loss, dtype=torch.float32, what=f"{family} loss")
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        # Gradients pass through every layer backwards; twice the single-op bound (as test_families).
        assert_close(grad, eager_grads[name], dtype=torch.float32, factor=2.0, what=f"{family} grad {name}")
    bound = {e.kind for e in entries if e.kernel and not e.left_to_compiler}
    assert bound <= set(calls), f"{family}: bound but never called: {bound - set(calls)}"


@pytest.mark.parametrize(("family", "overrides", "rotating"), [
    ("smollm3", {"num_hidden_layers": 4}, [True, True, True, False]),  # every fourth layer without RoPE
    ("flint", {"layer_types": ["sliding_attention", "full_attention"]}, [True, False]),  # only sliding layers rotate
])
def test_rotary_is_bound_only_where_the_layer_rotates(family, overrides, rotating, ref_pm, calls):
    """A layer whose forward names apply_rotary_pos_emb but skips it (NoPE, Flint's full attention) is declined with
    that reason; every layer reported bound calls the kernel."""
    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {family}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_family_causal_lm(family, **overrides)
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    rows = sorted((e for e in kernels_core.get_report(model).entries if e.kind == "rotary_embedding"),
                  key=lambda e: e.module)
    assert [bool(e.kernel) for e in rows] == rotating, [(e.module, e.kernel, e.reason) for e in rows]
    for entry in rows:
        assert entry.kernel or "does not call apply_rotary_pos_emb" in entry.reason, entry.reason
    calls.clear()
    model(input_ids=torch.randint(3, 100, (1, 6)))
    assert calls["rotary_embedding"] == sum(rotating)
