"""Packed rows on an NVIDIA GPU through ``kernels_core.kernelize`` with kernels-cuda: the packed_attention kind
binds torch's FlashAttention varlen kernel (``cuda.packed_attention.torch``) and the kernelized model trains like
eager transformers in the same setting (per document without a cache; Gemma 3's sliding layers banded too). Under
torch.compile the ``masked`` variant (``any.packed_attention.flex``: FlexAttention over the mask's tiles, compiled by
Inductor) trains like eager too.

bf16 throughout (FlashAttention takes nothing else): eager's dense-mask SDPA and the varlen kernel both round
their output once to bf16 (2^-8 relative), so losses agree within 1e-2 relative over 10 AdamW steps, and the
first step's gradients within 5e-2 relative norm error.
"""

from __future__ import annotations

import copy

import pytest
import torch


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)

LENGTHS = (37, 300, 1, 130, 64, 211)


def _packed(vocab):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (1, sum(LENGTHS)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


# The kernel kernelize picks eagerly, and under torch.compile the masked variant's.
KERNELS = {"varlen": ("cuda.packed_attention.torch", False), "compiled": ("any.packed_attention.flex", True)}


@pytest.mark.parametrize("family,extra", [
    ("qwen3", {}),
    ("gemma3_text", {"sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"]}),
], ids=["qwen3", "gemma3-sliding"])
@pytest.mark.parametrize("kernel", KERNELS, ids=KERNELS)
def test_packed_rows_train_like_eager(family, extra, kernel):
    import kernels_core
    from kernels_core.testing import tiny_causal_lm

    expected, compiled = KERNELS[kernel]
    model = tiny_causal_lm(family, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=509,
                           max_position_embeddings=512, **extra).cuda().train()
    twin = copy.deepcopy(model)
    mode = kernels_core.Mode.TRAINING | (kernels_core.Mode.TORCH_COMPILE if compiled else kernels_core.Mode(0))
    kernels_core.kernelize(twin, mode=mode)
    bound = {e.kernel for e in kernels_core.get_report(twin).entries if e.kind == "packed_attention"}
    assert bound == {expected}, kernels_core.get_report(twin)
    batch = _packed(model.config.vocab_size)
    losses = {}
    torch._dynamo.reset()
    for name, m in (("eager", model), ("kernelize", torch.compile(twin) if compiled else twin)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(10):
            loss = m(**batch).loss
            loss.backward()
            if step == 0:
                losses[f"{name}_grads"] = [p.grad.float().clone() for p in m.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["kernelize"]), torch.tensor(losses["eager"]), rtol=1e-2, atol=0)
    for got, want in zip(losses["kernelize_grads"], losses["eager_grads"], strict=True):
        assert (got - want).norm() <= 5e-2 * want.norm() + 1e-6
