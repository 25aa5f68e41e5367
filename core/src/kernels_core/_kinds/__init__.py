"""The layer kinds the core ships, declared as plain data (no torch import here).

Each kind names a lazy matcher, which decides from a module's structure *and* a numerical probe of its own
forward whether the module computes the kind's math, and a lazy adapter, which builds the per-instance forward
that calls a kernel following the kind's calling convention (``docs/kernel-conventions.md``). ``options`` lists
what each adapter reads from ``[kinds.<name>] options``, so that configuration naming anything else raises.
"""

from __future__ import annotations

from .._types import LayerKind


__all__ = ["CORE_KINDS"]

_P = "kernels_core._kinds"
# Both gated-MLP kinds: False keeps act(gate) * up for down_proj's weight gradient, as eager does, instead of
# recomputing it in backward (one [tokens, intermediate] tensor a layer less kept).
_GATED_MLP_OPTIONS = {"recompute_product": bool}

CORE_KINDS: tuple[LayerKind, ...] = (
    LayerKind(
        name="rms_norm",
        description="RMS normalisation, standard or (1 + weight) offset",
        variants=("standard", "offset"),
        matcher=f"{_P}._norms:match_rms_norm",
        adapter=f"{_P}._norms:adapt_rms_norm",
        options={},
        hint_names=("RMSNorm",),
    ),
    LayerKind(
        name="residual_rms_norm",
        description="pre-norm decoder layer: residual add after attention + post_attention_layernorm (RMSNorm) fused",
        variants=("standard", "offset"),
        matcher=f"{_P}._decoder:match_residual_rms_norm",
        adapter=f"{_P}._decoder:adapt_residual_rms_norm",
        options={},
    ),
    LayerKind(
        name="layer_norm",
        description="LayerNorm over the last dimension",
        variants=("bias", "no_bias"),
        matcher=f"{_P}._norms:match_layer_norm",
        adapter=f"{_P}._norms:adapt_layer_norm",
        options={},
        hint_names=("LayerNorm",),
    ),
    LayerKind(
        name="silu_gated_mlp",
        description="down(silu(gate(x)) * up(x)) MLP (SwiGLU)",
        variants=("split", "fused"),
        matcher=f"{_P}._mlp:match_silu_gated_mlp",
        adapter=f"{_P}._mlp:adapt_gated_mlp",
        options=_GATED_MLP_OPTIONS,
        hint_names=("SwiGLUMLP", "MLP"),
    ),
    LayerKind(
        name="gelu_gated_mlp",
        description="down(gelu_tanh(gate(x)) * up(x)) MLP (GeGLU)",
        variants=("split", "fused"),
        matcher=f"{_P}._mlp:match_gelu_gated_mlp",
        adapter=f"{_P}._mlp:adapt_gated_mlp",
        options=_GATED_MLP_OPTIONS,
        hint_names=("GeGLUMLP",),
    ),
    LayerKind(
        name="rotary_embedding",
        description="apply_rotary_pos_emb used by an attention module (rerouted per instance)",
        variants=("full", "partial", "interleaved"),
        matcher=f"{_P}._rotary:match_rotary",
        adapter=f"{_P}._rotary:adapt_rotary",
        options={},
        hint_names=("rotary_pos_emb",),
        target="global",
    ),
    LayerKind(
        name="causal_mask",
        description="create_causal_mask used by a base model's forward (rerouted per instance)",
        variants=("sdpa",),
        matcher=f"{_P}._masks:match_causal_mask",
        adapter=f"{_P}._masks:adapt_causal_mask",
        options={},
        target="global",
    ),
    LayerKind(
        name="sliding_window_attention",
        description="the sdpa attention function of a sliding-window layer (Gemma-2/3; rerouted per instance)",
        variants=("sdpa",),
        matcher=f"{_P}._attention:match_sliding_window_attention",
        adapter=f"{_P}._attention:adapt_sliding_window_attention",
        options={},
        target="global",
    ),
    LayerKind(
        name="packed_attention",
        description="the sdpa attention function of a causal attention module, for packed rows: each document's "
                    "attention without the dense mask (rerouted per instance; any other mask goes to sdpa)",
        variants=("causal", "sliding_window", "masked"),
        matcher=f"{_P}._packed:match_packed_attention",
        adapter=f"{_P}._packed:adapt_packed_attention",
        options={},
        hint_names=("varlen",),
        target="global",
    ),
    LayerKind(
        name="causal_lm_loss",
        description="lm_head + shifted cross-entropy of a *ForCausalLM model (fused linear cross-entropy); \"scaled\" "
                    "takes a logit_scale factor (Granite, Command-R), applied as eager does in the logits' dtype "
                    "(other placements: within one rounding per logit, see the kernel conventions)",
        variants=("standard", "softcap", "scaled"),
        matcher=f"{_P}._causal_lm:match_causal_lm",
        adapter=f"{_P}._causal_lm:adapt_causal_lm",
        # Keep computing the [tokens, vocab] logits in training (metrics that read them); costs the memory
        # the fused loss saves.
        options={"materialize_logits": bool},
        hint_names=("ForCausalLMLoss",),
    ),
    LayerKind(
        name="moe_experts",
        description="transformers 5 *Experts module (3-D gate_up_proj / down_proj)",
        variants=("silu", "gelu_tanh"),
        matcher=f"{_P}._experts:match_experts",
        adapter=f"{_P}._experts:adapt_experts",
        options={},
    ),
    LayerKind(
        name="linear",
        description="nn.Linear projections of decoder layers, opt-in (FP8 matrix products change the numbers)",
        variants=("projection", "head"),
        matcher=f"{_P}._dense:match_linear",
        adapter=f"{_P}._dense:adapt_linear",
        # Take the lm_head too (variant "head"); by default it keeps its own precision.
        options={"lm_head": bool},
        conformance=f"{_P}._dense:conformance_cases",
        opt_in=True,
    ),
)
