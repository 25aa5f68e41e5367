"""Greedy ``generate`` of a kernelized model returns the eager model's tokens, in float32 (where kernels and eager
agree to ~1e-6, far below the logit gaps greedy decoding depends on), with a dynamic and a static cache, on the
Llama and Qwen3 layouts the decode benchmark measures. On CPU the core's portable kernels apply; on a GPU the CUDA
plugin's.
"""

from __future__ import annotations

import pytest
import torch


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"))]

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=211, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def _model(family: str, device: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
                                          attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**SMALL, tie_word_embeddings=True, attn_implementation="sdpa")
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_kernelized_generate_returns_eager_tokens(device, cache, family, batch):
    import kernels_core

    model = _model(family, device)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, SMALL["vocab_size"], (batch, 7), generator=gen).to(device)
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, disable_compile=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        eager_logits = model(eager).logits
    kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
    assert kernels_core.get_report(model).applied, "kernelize applied no kernel: the test would compare eager twice"
    with torch.no_grad():
        ours = model.generate(ids, **kwargs)
        ours_logits = model(eager).logits
    assert torch.equal(ours, eager)
    assert torch.allclose(ours_logits, eager_logits, rtol=1e-4, atol=1e-4)
