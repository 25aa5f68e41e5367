"""kernelize composes with accelerate's hooks (``from_pretrained(device_map=...)``, ``dispatch_model``).

accelerate moves a module's class forward to ``_old_forward`` and installs a hook-calling partial as
``forward``. Kernels must go into ``_old_forward`` so the hooks (device moves, offloading) keep running around
them, function kernels such as RoPE must still be rerouted, and unkernelize must give accelerate its forwards back.
Here every block is dispatched to the CPU with hooks forced, which installs the same hooks a multi-GPU
``device_map`` does; the two-GPU version is in plugins-cuda's ``test_distributed_gpu.py``.
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import tiny_causal_lm


accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}


def _forwards(model: torch.nn.Module) -> dict[str, tuple[object, object]]:
    return {name: (m.__dict__.get("forward"), m.__dict__.get("_old_forward")) for name, m in model.named_modules()}


@pytest.fixture
def dispatched():
    model = accelerate.dispatch_model(tiny_causal_lm("qwen3"), device_map=DEVICE_MAP, force_hooks=True)
    hooked = [name for name, m in model.named_modules() if "_hf_hook" in m.__dict__]
    assert "model.layers.0.self_attn" in hooked, "accelerate did not hook the attention modules"
    return model.eval()


def test_every_kind_is_bound_under_accelerate_hooks(dispatched, ref_pm, calls):
    ids = torch.randint(3, 100, (1, 7))
    eager_tokens = dispatched.generate(ids, max_new_tokens=8, do_sample=False)
    hooks = {name: m.__dict__["forward"] for name, m in dispatched.named_modules() if "_hf_hook" in m.__dict__}

    kernels_core.kernelize(dispatched, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    report = kernels_core.get_report(dispatched)
    # In inference the fused loss never runs (no training step), so the loss kind is declined, with that reason.
    loss = [e for e in report.skipped if e.kind == "causal_lm_loss"]
    assert loss and all("only in training steps" in e.reason for e in loss)
    missing = [(e.module, e.kind, e.reason) for e in report.skipped if e.kind != "causal_lm_loss"]
    assert not missing, f"modules left without a kernel under accelerate hooks: {missing}"
    assert {e.kind for e in report.entries} >= {"rms_norm", "rotary_embedding", "silu_gated_mlp"}
    for name, module in dispatched.named_modules():
        if name in hooks:  # accelerate's hook still wraps the module; the kernel sits inside it
            assert module.__dict__["forward"] is hooks[name], f"{name}: accelerate's hook was replaced"

    calls.clear()
    tokens = dispatched.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, eager_tokens), "greedy generation differs from eager under accelerate hooks"
    assert {"rms_norm", "rotary_embedding", "silu_gated_mlp"} <= set(calls), f"kernels not called: {dict(calls)}"


def test_unkernelize_restores_accelerate_forwards(dispatched, ref_pm):
    before = _forwards(dispatched)
    kernels_core.kernelize(dispatched, mode=Mode.TRAINING, plugin_manager=ref_pm)
    assert _forwards(dispatched) != before
    kernels_core.unkernelize(dispatched)
    after = _forwards(dispatched)
    for name, (forward, old_forward) in before.items():
        assert after[name][0] is forward, f"{name}: forward not restored"
        # A bound method is re-created on each attribute read; equality compares function and instance.
        assert after[name][1] == old_forward, f"{name}: _old_forward not restored"
    ids = torch.randint(3, 100, (1, 5))
    assert dispatched(input_ids=ids).logits.shape == (1, 5, dispatched.config.vocab_size)


def test_training_under_hooks_matches_eager(dispatched, ref_pm):
    ids = torch.randint(3, 100, (2, 9))
    dispatched.train()
    eager = dispatched(input_ids=ids, labels=ids).loss
    kernels_core.kernelize(dispatched, mode=Mode.TRAINING, plugin_manager=ref_pm)
    fused = dispatched(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=0.0)
