"""The gated MLP's product recomputed in backward, with this plugin's kernels, on an NVIDIA GPU.

kernels-triton's gated kernel writes the gradients of gate and up into their own storage: through the recomputing
path too, the gradients of every parameter must be the ones of the plain path (``recompute_product = false``) bit
for bit, in bf16 as models train, for the split (Llama), fused (Phi-3) and GeGLU (Gemma) layouts; and one
``[tokens, intermediate]`` tensor a layer, the product, is no longer kept for backward.
"""

from __future__ import annotations

import weakref

import pytest
import torch


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)

SMALL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=257, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "phi3": ("Phi3Config", {}),
    "gemma": ("GemmaConfig", dict(hidden_activation="gelu_pytorch_tanh")),
}
KEEP = {"kinds": {kind: {"options": {"recompute_product": False}} for kind in ("silu_gated_mlp", "gelu_gated_mlp")}}


def _model(family: str, *, recompute: bool):
    import kernels_core
    import transformers

    cls_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**{**SMALL, **extra}))
    model = model.to("cuda", torch.bfloat16)
    kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING, config=None if recompute else KEEP)
    mlps = [e.kernel for e in kernels_core.get_report(model).applied if e.kind.endswith("_gated_mlp")]
    assert len(mlps) == SMALL["num_hidden_layers"] and all(k.startswith("cuda.") for k in mlps), mlps
    return model


def _products_kept(model, ids) -> int:
    """How many layers' ``act(gate) * up`` (down_proj's input) stay alive once the forward returned: only autograd's
    saved tensors hold them then."""
    seen = []
    handles = [layer.mlp.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(weakref.ref(args[0])))
               for layer in model.model.layers]
    loss = model(input_ids=ids, labels=ids).loss
    for handle in handles:
        handle.remove()
    kept = sum(product() is not None for product in seen)
    del loss
    return kept


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_equal_the_plain_path_and_less_is_kept(family):
    ids = torch.randint(3, SMALL["vocab_size"], (2, 96), device="cuda")
    results = []
    for recompute in (True, False):
        model = _model(family, recompute=recompute)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                        _products_kept(model, ids)))
    (loss_r, grads_r, kept_r), (loss_k, grads_k, kept_k) = results
    assert torch.equal(loss_r, loss_k)
    assert grads_r.keys() == grads_k.keys()
    for name in grads_r:
        assert torch.equal(grads_r[name], grads_k[name]), name
    assert (kept_r, kept_k) == (0, SMALL["num_hidden_layers"])
