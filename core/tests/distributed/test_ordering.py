"""kernelize before or after FSDP2 (``fully_shard``) or DDP gives the same kernels and the same losses; under
transformers' tensor parallelism (``tp_plan="auto"``) it keeps every loss and gradient and says what it declined.

Two CPU processes over the gloo backend, so CI covers the ordering logic without GPUs: after ``fully_shard`` the
parameters are sharded DTensors and the probes must gather them (in step on every rank) instead of failing.
The same checks on two GPUs with NCCL live in plugins-cuda's ``test_distributed_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import two_ranks


pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend",
)

WORKER = Path(__file__).with_name("_worker.py")


def _launch(scenario: str, out: Path) -> list[dict]:
    return two_ranks.launch(WORKER, scenario, out)


@pytest.mark.parametrize("scenario", ["fsdp", "ddp"])
def test_kernelize_before_or_after_wrapping_is_the_same(scenario, tmp_path):
    ranks = _launch(scenario, tmp_path)
    for rank, result in enumerate(ranks):
        before, after, eager = result["before"], result["after"], result["eager"]
        assert before["kernels"], f"rank {rank}: kernelize before {scenario} produced no report"
        assert after["kernels"] == before["kernels"], f"rank {rank}: kernels differ by order"
        declined = {k: v for k, v in after["kernels"].items() if str(v).startswith("declined")}
        assert not declined, f"rank {rank}: declined after {scenario}: {declined}"
        expected_kinds = {"causal_lm_loss", "rms_norm", "rotary_embedding", "silu_gated_mlp"}
        assert set(after["called"]) == set(before["called"]) >= expected_kinds
        # The reference kernels compute the eager math in float32: every step's loss agrees to rounding.
        for order in (before, after):
            torch.testing.assert_close(torch.tensor(order["losses"]), torch.tensor(eager["losses"]),
                                       rtol=1e-5, atol=0.0)
        if scenario == "fsdp":
            # The probes gathered the shards and gave them back: the model is sharded again after kernelize.
            assert after["sharded_after_kernelize"] is True
    assert ranks[0]["after"]["losses"] == ranks[1]["after"]["losses"], "ranks disagree on the mean loss"


def test_tensor_parallel_keeps_losses_and_declines_what_needs_full_weights(tmp_path):
    for rank, result in enumerate(_launch("tp", tmp_path)):
        assert result["sharded"], f"rank {rank}: transformers did not shard anything; the test proves nothing"
        kernels = result["kernels"]
        # Kernels working on the plain activations between TP's hooks (norms with replicated weights, RoPE on
        # the local heads, the gated MLP's elementwise product between sharded projections) are used ...
        assert {"rms_norm", "rotary_embedding", "silu_gated_mlp"} <= set(result["called"]), result["called"]
        # ... the fused loss, which would read a vocabulary-sharded lm_head weight directly, is declined, and so
        # are norms whose forward TP wrapped per instance (q_norm/k_norm: it registers the gradient all-reduce).
        if result["lm_head_sharded"]:
            assert "tensor parallel" in str(kernels["|causal_lm_loss"]), kernels["|causal_lm_loss"]
        else:  # transformers 5.6 keeps lm_head whole: the fused loss is correct there, and used
            assert "causal_lm_loss" in result["called"], kernels["|causal_lm_loss"]
        for name, kernel in kernels.items():
            if name.endswith(("q_norm|rms_norm", "k_norm|rms_norm")) and result["tp_wrapped_norms"]:
                assert "replaced by other code" in str(kernel), f"{name}: {kernel}"
        assert result["loss"] == pytest.approx(result["eager_loss"], rel=1e-5)
        assert result["max_grad_rel_error"] < 1e-5
