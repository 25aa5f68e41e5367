"""Conformance cases of the core layer kinds: small transformers modules every kernel of a kind must reproduce.

Each case builds a real module (a tiny transformers model, or one layer of it) whose math is the kind's in one
variant, with sizes that are neither powers of two nor multiples of a vector width: hidden size 44 (rotary head
dimension 12), MLP width 67, vocabulary 101, a standalone norm of width 37, 2 x 7 tokens. Norm weights are
perturbed away from their ones / zeros initialisation, so the weight's rounding and gradient are exercised. The
kind's own matcher must accept the module in the case's variant before any kernel is compared with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import ConformanceCase


__all__ = ["CORE_CASES", "FAMILIES", "tiny_causal_lm", "tiny_family_causal_lm"]

# Tiny configurations of the families the core is tested on; sizes are odd where the architecture allows.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {"hidden_activation": "gelu_pytorch_tanh"},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4},
    "phi3": {"pad_token_id": 0},
}


def tiny_causal_lm(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   **overrides: Any) -> torch.nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` of ``model_type`` with two small layers (no download)."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    settings: dict[str, Any] = {
        "hidden_size": 48, "intermediate_size": 72, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 101, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }
    settings.update(FAMILIES.get(model_type, {}))
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


# Sizes every architecture's defaults are shrunk to (where the configuration has the setting): the defaults are those
# of a released checkpoint (billions of parameters); MoE keeps a routed layer (first_k_dense_replace 1) with 4 experts.
_TINY: dict[str, int] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "intermediate_size": 96, "ffn_dim": 96, "decoder_ffn_dim": 96,
    "num_hidden_layers": 2, "n_layer": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "decoder_sparse_step": 1,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "index_head_dim": 32,
    "index_n_heads": 2, "n_shared_experts": 1,
    # State-space layers (Bamba, Falcon-H1): transformers' reference scan (no mamba_ssm on a CPU) holds
    # heads x chunk x chunk x state intermediates; the defaults (128 x 256 x 256 x 256) take 17 GB in 5.6.
    "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 32, "mamba_d_ssm": 128,
    # Families that count their layers as num_layers (EXAONE, LongCat-Flash, whose transformers 5.6 configuration
    # also keeps num_hidden_layers) and name their feed-forward widths their own way.
    "num_layers": 2, "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32,
}
_UNSET: dict[str, int] = {"num_experts_per_tok": 2}


def tiny_family_causal_lm(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                          **overrides: Any) -> torch.nn.Module:
    """Any transformers causal-LM ``model_type``, built from its configuration's own defaults shrunk to two layers of
    width 64 (the settings of ``_TINY`` it has, then ``overrides``), randomly initialised, no download.

    Unlike :func:`tiny_causal_lm`, which tunes a few families by hand, this serves a sweep over every model type
    transformers ships; what a family's defaults leave large (a sliding window, a vocabulary of its own) stays.
    Where the configuration chooses per layer (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``), the tiny
    model has each kind of layer it names (more than two layers where it names more kinds), unless the defaults
    cannot build one of them, in which case it has the first layers.

    Example:
        >>> model = tiny_family_causal_lm("qwen3")  # doctest: +SKIP
        >>> model.config.hidden_size, model.config.num_hidden_layers  # doctest: +SKIP
        (64, 2)
    """
    from transformers import AutoConfig

    text = AutoConfig.for_model(model_type).get_text_config()
    settings = {k: v for k, v in _TINY.items() if isinstance(getattr(text, k, None), int)}
    # Settings a family's defaults leave unset (None) although its layers need them (DeepSeek-V2's top-k).
    settings.update({k: v for k, v in _UNSET.items() if hasattr(text, k) and getattr(text, k) is None})
    layers = overrides.get("num_hidden_layers", settings.get("num_hidden_layers", 2))
    per_layer = {key: value for key, value in _per_layer_lists(text).items() if key not in overrides}
    if per_layer and "num_hidden_layers" not in overrides:
        # Every kind of layer the family has gets built: a hybrid's full-attention layers, a MoE's routed ones.
        layers = max(layers, *(len(set(value)) for value in per_layer.values()))
        settings["num_hidden_layers"] = layers
    for key, value in per_layer.items():
        settings[key] = _representative(value, layers)
    if "num_layers" in settings:  # the same count under the family's own name
        settings["num_layers"] = settings.get("num_hidden_layers", layers)
    if "kv_lora_rank" in settings:  # multi-head latent attention: every head has its own keys
        settings["num_key_value_heads"] = settings.get("num_attention_heads", 4)
    for token, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if getattr(text, token, None) is not None:
            settings[token] = value
    settings.update(overrides)
    try:
        return _build(model_type, settings, seed, dtype)
    except Exception:
        if not per_layer:
            raise
    # A kind of layer the defaults cannot build (Qwen4-Exp's indexed attention has no indexer sizes): the first
    # layers only, as the defaults order them.
    for key, value in per_layer.items():
        settings[key] = value[: settings["num_hidden_layers"]]
    return _build(model_type, settings, seed, dtype)


def _build(model_type: str, settings: dict[str, Any], seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``model_type`` from its defaults with ``settings`` (set on the text configuration of a
    multimodal one)."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    defaults = AutoConfig.for_model(model_type)
    text = defaults.get_text_config()
    if text is defaults:
        config = AutoConfig.for_model(model_type, **settings)
    else:
        config = defaults
        for key, value in settings.items():
            setattr(text, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def _per_layer_lists(config: object) -> dict[str, list[Any]]:
    """The configuration's per-layer choices: lists with one entry per layer that name a type (``layer_types``,
    ``mlp_layer_types``) or set a flag (``no_rope_layers``' 1 and 0), not lists of layer indices."""
    count = getattr(config, "num_hidden_layers", None)
    found: dict[str, list[Any]] = {}
    for key, value in vars(config).items():
        if not isinstance(value, (list, tuple)) or len(value) != count or key.startswith("_"):
            continue
        if all(isinstance(v, str) for v in value) or all(isinstance(v, (bool, int)) and v in (0, 1) for v in value):
            found[key] = list(value)
    return found


def _representative(value: list[Any], layers: int) -> list[Any]:
    """The first ``layers`` entries of a per-layer list, with a repeated entry (the last first) given up for each
    choice the list makes only further down, so that a tiny model has every kind of layer.

    Example:
        >>> _representative(["sliding", "sliding", "sliding", "full"], 2)
        ['sliding', 'full']
    """
    chosen = list(value[:layers])
    for missing in [v for v in dict.fromkeys(value) if v not in chosen]:
        repeated = [i for i, v in enumerate(chosen) if chosen.count(v) > 1]
        if not repeated:
            break
        chosen[repeated[-1]] = missing
    return chosen


_HIDDEN = 44
_SETTINGS = {"hidden_size": _HIDDEN, "intermediate_size": 67, "vocab_size": 101, "head_dim": 12}
_BATCH, _TOKENS = 2, 7


def _perturb_norms(module: nn.Module, generator: torch.Generator) -> None:
    """Norm weights of 1 + N(0, 0.5) (standard) or N(0, 0.5) (offset): a fresh norm's constant weight would hide
    a wrong casting order or a missing weight gradient."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() == 1 and "norm" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.5
                param.add_(noise.to(param.dtype))


def _model(family: str, **overrides: Any) -> Callable[[torch.device, torch.dtype], nn.Module]:
    def build(device: torch.device, dtype: torch.dtype) -> nn.Module:
        model = tiny_causal_lm(family, dtype=dtype, **{**_SETTINGS, **overrides})
        _perturb_norms(model, torch.Generator().manual_seed(7))
        return model.to(device)

    return build


def _in(build: Callable[[torch.device, torch.dtype], nn.Module], target: str
        ) -> Callable[[torch.device, torch.dtype], tuple[nn.Module, str]]:
    def located(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str]:
        return build(device, dtype), target

    return located


def _hidden(target: nn.Module, generator: torch.Generator, width: int) -> torch.Tensor:
    parameter = next(target.parameters())
    x = torch.randn(_BATCH, _TOKENS, width, generator=generator, device=generator.device)
    return (x * 2 + 0.3).to(device=parameter.device, dtype=parameter.dtype)


def _norm_inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_hidden(target, generator, target.weight.shape[0]),), {}


def _mlp_inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_hidden(target, generator, _HIDDEN),), {}


def _standalone_norm(family: str, width: int) -> Callable[[torch.device, torch.dtype], tuple[nn.Module, str]]:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str]:
        model = _model(family)(torch.device("cpu"), dtype)
        norm = type(model.model.norm)(width, eps=1e-5)
        _perturb_norms(nn.ModuleDict({"norm": norm}), torch.Generator().manual_seed(3))
        return norm.to(device=device, dtype=dtype), ""

    return build


class _WithPositions:
    """Inputs of a decoder layer or attention module: hidden states and the model's own rotary (cos, sin)."""

    def __init__(self, *, layer: bool) -> None:
        self.layer = layer

    def __call__(self, target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = _hidden(target, generator, _HIDDEN)
        rotary = target.__dict__.get("_conformance_rotary")
        position_ids = torch.arange(_TOKENS, device=x.device)[None].expand(_BATCH, -1)
        cos, sin = rotary(x, position_ids)
        kwargs: dict[str, Any] = {"position_embeddings": (cos, sin), "attention_mask": None}
        if self.layer:
            kwargs["position_ids"] = position_ids
        return (x,), kwargs


class _SlidingInputs:
    """Inputs of a sliding-window attention module: hidden states, its layer type's rotary (cos, sin) and the
    boolean band mask SDPA receives from transformers, with two padded positions in the first sequence."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __call__(self, target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = _hidden(target, generator, _HIDDEN)
        position_ids = torch.arange(_TOKENS, device=x.device)[None].expand(_BATCH, -1)
        cos, sin = target.__dict__["_conformance_rotary"](x, position_ids, target.layer_type)
        i = torch.arange(_TOKENS, device=x.device)
        band = (i[None] <= i[:, None]) & (i[None] > i[:, None] - self.window)
        keep = torch.ones(_BATCH, _TOKENS, dtype=torch.bool, device=x.device)
        keep[0, :2] = False
        mask = band[None, None] & keep[:, None, None, :]
        mask[0, 0, :2, 0] = True  # padded queries keep one key, as transformers' sdpa masks do
        return (x,), {"position_embeddings": (cos, sin), "attention_mask": mask}


def _with_rotary(family: str, target: str, **overrides: Any
                 ) -> Callable[[torch.device, torch.dtype], tuple[nn.Module, str]]:
    def build(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str]:
        model = _model(family, **overrides)(device, dtype)
        # The inputs need the model's rotary embedding; a plain attribute (not a sub-module) of the target.
        model.get_submodule(target).__dict__["_conformance_rotary"] = model.model.rotary_emb
        return model, target

    return build


def _ids_inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    device = next(target.parameters()).device
    ids = torch.randint(3, 101, (_BATCH, _TOKENS), generator=generator, device=generator.device).to(device)
    return (), {"input_ids": ids}


def _loss_inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    _, kwargs = _ids_inputs(target, generator)
    labels = kwargs["input_ids"].clone()
    labels[0, :3] = -100  # a masked prompt
    return (), {**kwargs, "labels": labels}


def _experts_inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gate_up = target.gate_up_proj
    tokens, experts = 11, gate_up.shape[0]
    x = torch.randn(tokens, gate_up.shape[-1], generator=generator, device=generator.device)
    scores = torch.randn(tokens, experts, generator=generator, device=generator.device).softmax(-1)
    weights, index = torch.topk(scores, 2, dim=-1)
    device, dtype = gate_up.device, gate_up.dtype
    return (x.to(device=device, dtype=dtype), index.to(device), weights.to(device=device, dtype=dtype)), {}


def _last_hidden(output: Any) -> tuple[torch.Tensor, ...]:
    return (output.last_hidden_state,)


def _loss(output: Any) -> tuple[torch.Tensor, ...]:
    return (output.loss,)


_LAYER = "model.layers.0"

CORE_CASES: dict[str, tuple[ConformanceCase, ...]] = {
    "rms_norm": (
        ConformanceCase("standard", "LlamaRMSNorm(37)", _standalone_norm("llama", 37), _norm_inputs),
        ConformanceCase("offset", "GemmaRMSNorm(37)", _standalone_norm("gemma", 37), _norm_inputs),
    ),
    "residual_rms_norm": (
        # The kernel sits inside a whole decoder layer: attention and MLP gradients flow through it.
        ConformanceCase("standard", "LlamaDecoderLayer", _with_rotary("llama", _LAYER), _WithPositions(layer=True),
                        factor=2.0),
        ConformanceCase("offset", "GemmaDecoderLayer", _with_rotary("gemma", _LAYER), _WithPositions(layer=True),
                        factor=2.0),
    ),
    "layer_norm": (
        ConformanceCase("bias", "LayerNorm(37)", lambda d, t: (nn.LayerNorm(37).to(device=d, dtype=t), ""),
                        _norm_inputs),
        ConformanceCase("no_bias", "LayerNorm(37, bias=False)",
                        lambda d, t: (nn.LayerNorm(37, bias=False).to(device=d, dtype=t), ""), _norm_inputs),
    ),
    "silu_gated_mlp": (
        ConformanceCase("split", "LlamaMLP", _in(_model("llama"), f"{_LAYER}.mlp"), _mlp_inputs),
        ConformanceCase("fused", "Phi3MLP", _in(_model("phi3"), f"{_LAYER}.mlp"), _mlp_inputs),
    ),
    "gelu_gated_mlp": (
        ConformanceCase("split", "GemmaMLP", _in(_model("gemma"), f"{_LAYER}.mlp"), _mlp_inputs),
        ConformanceCase("fused", "Phi3MLP (tanh GELU)",
                        _in(_model("phi3", hidden_act="gelu_pytorch_tanh"), f"{_LAYER}.mlp"), _mlp_inputs),
    ),
    "rotary_embedding": (
        ConformanceCase("full", "LlamaAttention", _with_rotary("llama", f"{_LAYER}.self_attn"),
                        _WithPositions(layer=False), factor=2.0),
        ConformanceCase("partial", "Phi3Attention (half rotary)",
                        _with_rotary("phi3", f"{_LAYER}.self_attn", partial_rotary_factor=0.5),
                        _WithPositions(layer=False), factor=2.0),
    ),
    "causal_mask": (
        # Eagerly the kernel hands the call to transformers; under torch.compile it returns no mask, and the
        # model's output must not change.
        ConformanceCase("sdpa", "LlamaModel", _in(_model("llama"), "model"), _ids_inputs, outputs=_last_hidden,
                        factor=2.0),
    ),
    "sliding_window_attention": (
        # A 2-token window over 7 tokens: four query blocks, each over the keys its window reaches.
        ConformanceCase("sdpa", "Gemma3Attention (sliding, window 2)",
                        _with_rotary("gemma3_text", f"{_LAYER}.self_attn", sliding_window=2), _SlidingInputs(2)),
    ),
    "causal_lm_loss": (
        ConformanceCase("standard", "LlamaForCausalLM", _in(_model("llama"), ""), _loss_inputs, outputs=_loss,
                        factor=2.0),
        ConformanceCase("softcap", "Gemma2ForCausalLM", _in(_model("gemma2", final_logit_softcapping=3.0), ""),
                        _loss_inputs, outputs=_loss, factor=2.0),
    ),
    # transformers' grouped matmul needs rows of a multiple of 16 bytes in half precision: width 40, not 44.
    "moe_experts": (
        ConformanceCase("silu", "Qwen3MoeExperts", _in(_model("qwen3_moe", hidden_size=40), f"{_LAYER}.mlp.experts"),
                        _experts_inputs),
        ConformanceCase("gelu_tanh", "Qwen3MoeExperts (tanh GELU)",
                        _in(_model("qwen3_moe", hidden_size=40, hidden_act="gelu_pytorch_tanh"),
                            f"{_LAYER}.mlp.experts"), _experts_inputs),
    ),
}
