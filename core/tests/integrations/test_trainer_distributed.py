"""``KernelizeCallback`` in a ``Trainer`` that wraps the model for two processes: DDP and accelerate's FSDP2.

Two CPU processes over gloo, launched with ``torch.distributed.run``; each trains the plain Trainer and then the
Trainer with the callback from the same seed on the same data (float32, 8 steps) and compares the logged loss of
every step (the mean over both ranks). The fused loss differs from eager by summation order only: 1e-4 relative,
as in ``test_transformers.py``.

FSDP2: accelerate keeps ``FullyShardedDataParallelPlugin`` only for GPU/NPU/XPU-style distributed types; with
``use_cpu=True`` (MULTI_CPU) it drops the plugin without a message and the Trainer wraps in DDP. The worker puts
the Trainer's accelerator state on FSDP after ``Trainer.__init__`` (after the callback has kernelized, before
anything is wrapped), so ``train()`` runs accelerate's own FSDP2 preparation (``fully_shard`` per its auto-wrap
policy); the test checks that the parameters really are sharded DTensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import two_ranks
from _trainer_helpers import assert_losses_equal


pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend",
)

WORKER = Path(__file__).with_name("_trainer_distributed_worker.py")
# Kinds the core's portable kernels give the tiny Qwen3 on the CPU (RoPE has no portable kernel).
EXPECTED = {"causal_lm_loss", "rms_norm", "silu_gated_mlp"}


def _launch(scenario: str, out: Path) -> list[dict]:
    return two_ranks.launch(WORKER, scenario, out)


def _check_same_training(ranks: list[dict], scenario: str) -> None:
    for rank, result in enumerate(ranks):
        plain, kernelized = result["plain"], result["kernelized"]
        assert plain["world_size"] == kernelized["world_size"] == 2, f"rank {rank}: not a two-process run"
        assert len(plain["losses"]) == 8
        assert_losses_equal(kernelized["losses"], plain["losses"], what=f"{scenario} rank {rank}")
        assert set(kernelized["applied"]) >= EXPECTED, f"rank {rank}: {kernelized['applied']}"
        assert set(kernelized["declined"]) <= {f"model.layers.{i}.self_attn|rotary_embedding" for i in (0, 1)}, (
            f"rank {rank}: {kernelized['declined']}")
        assert "kernels-core's fused loss" in kernelized["loss_owner"], kernelized["loss_owner"]
        # The eager loss calls lm_head once per step; the fused loss reads its weight and never calls it.
        assert plain["lm_head_calls"] == 8 and kernelized["lm_head_calls"] == 0, (
            f"rank {rank}: lm_head called {plain['lm_head_calls']} / {kernelized['lm_head_calls']} times")
    assert ranks[0]["kernelized"]["losses"] == ranks[1]["kernelized"]["losses"], "ranks disagree on the mean loss"


def test_ddp_trains_like_the_plain_trainer(tmp_path):
    ranks = _launch("ddp", tmp_path)
    for result in ranks:
        assert result["plain"]["wrapper"] == result["kernelized"]["wrapper"] == "DistributedDataParallel"
        assert result["kernelized"]["optimizer_step"] is None, "DDP has no sharded parameters to step locally"
    _check_same_training(ranks, "ddp")


def test_accelerate_fsdp2_trains_like_the_plain_trainer(tmp_path):
    ranks = _launch("fsdp", tmp_path)
    for rank, result in enumerate(ranks):
        for which in ("plain", "kernelized"):
            run = result[which]
            assert run["fsdp2_sharded"], f"rank {rank} {which}: parameters are not FSDP2 DTensors"
            assert "FSDPQwen3DecoderLayer" in run["fsdp2_modules"], f"rank {rank} {which}: {run['fsdp2_modules']}"
        # The Trainer's AdamW (inside accelerate's wrapper) steps the local shards; the losses below are the
        # plain Trainer's, whose AdamW goes through DTensor dispatch.
        assert result["kernelized"]["optimizer_step"].startswith("AdamW steps on local shards ("), result
    _check_same_training(ranks, "fsdp")
