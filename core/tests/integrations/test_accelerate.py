"""``Accelerator.prepare`` and kernelize compose in either order (the recipe in docs/integrations.md).

Both orders train the same tiny Qwen3 for a few steps with AdamW from the same seed and must give the plain
loop's losses. bf16 autocast is where the order shows: accelerate wraps the model's forward in autocast, so a
model kernelized before ``prepare`` keeps its fused loss inside the wrapper, while one kernelized after has
accelerate's wrapper as the ``*ForCausalLM``'s instance forward, and the loss kind leaves it alone (the report
says why); every other kernel is bound either way.
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from _trainer_helpers import pad_collate
from _trainer_helpers import token_dataset
from kernels_core import Mode
from kernels_core.testing import tiny_causal_lm


accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    # accelerate keeps one process-wide state; each loop here asks for its own mixed precision.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _loop(order, pm, *, mixed_precision="no", steps=5):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = tiny_causal_lm("qwen3")
    if order == "before":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(token_dataset(20), batch_size=4, collate_fn=pad_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if order == "after":
        kernels_core.kernelize(accelerator.unwrap_model(model), mode=Mode.TRAINING, plugin_manager=pm)
    model.train()
    losses = []
    for _, batch in zip(range(steps), loader, strict=False):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, accelerator.unwrap_model(model)


@pytest.mark.parametrize("order", ["before", "after"])
def test_prepare_before_or_after_kernelize_trains_like_plain(order, pm):
    plain, _ = _loop("plain", pm)
    losses, model = _loop(order, pm)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=0.0)
    assert {e.kind for e in kernels_core.get_report(model).applied} >= {"causal_lm_loss", "rms_norm"}


def test_bf16_autocast_keeps_the_fused_loss_only_when_kernelized_first(pm):
    plain, _ = _loop("plain", pm, mixed_precision="bf16")
    for order, fused in (("before", True), ("after", False)):
        losses, model = _loop(order, pm, mixed_precision="bf16")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=2e-3, atol=0.0)
        (entry,) = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
        assert entry.applied is fused, (order, entry)
        if not fused:
            assert "convert_outputs_to_fp32" in entry.reason, entry.reason
