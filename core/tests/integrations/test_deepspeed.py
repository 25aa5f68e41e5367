"""Real DeepSpeed, ZeRO-2 and ZeRO-3, on the CPU (one process, gloo): kernelize before the engine, after
``deepspeed.zero.Init`` partitioned the parameters, or after the engine; through ``deepspeed.initialize``,
accelerate and the transformers Trainer with ``KernelizeCallback``. Every order must apply the fused loss and the
residual add + norm (kernels that read a child's weight without calling the child), run them, and give the losses
(and, through the engine, every parameter's gradient) of the same model without kernels-core.

Each scenario runs ``_deepspeed_worker.py`` in its own process (DeepSpeed keeps process-wide state). Skipped where
deepspeed is not installed (``pip install 'kernels-core[deepspeed]'``): CI runs the same checks on
``zero3_standin`` (``core/tests/kinds/test_zero3.py``). The first run on a machine also builds DeepSpeed's CPU
shared-memory communication op (a few minutes; cached afterwards).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _trainer_helpers import assert_losses_equal


pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'kernels-core[deepspeed]')"),
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="this torch build has no torch.distributed with the gloo backend"),
]

WORKER = Path(__file__).with_name("_deepspeed_worker.py")
# The kinds every order must apply on the tiny Qwen3 (the reference plugin covers RoPE on the CPU too).
KINDS = {"causal_lm_loss", "residual_rms_norm", "rms_norm", "silu_gated_mlp"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(scenario: str, out: Path) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(WORKER), scenario, str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"{scenario} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads((out / f"{scenario}.json").read_text())


def _assert_kernels_ran(run: dict, what: str) -> None:
    report = run["report"]
    for kind in KINDS:
        entries = {module: v for module, v in report.items() if module.endswith(f"|{kind}")}
        assert entries, f"{what}: no module matched as {kind}"
        declined = {module: v for module, v in entries.items() if str(v).startswith("declined")}
        assert not declined, f"{what}: {declined}"


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> dict:
    return _run("engine", tmp_path_factory.mktemp("deepspeed"))


@pytest.mark.parametrize("run", ["3-before", "3-after", "3-init", "2-before", "2-after"])
def test_engine_losses_and_gradients_match_eager(engine_runs, run):
    stage, order = run.split("-")
    result, eager = engine_runs[run], engine_runs[f"{stage}-{'init-eager' if order == 'init' else 'eager'}"]
    if order == "init":
        assert result["partitioned_at_kernelize"], "zero.Init did not partition the model: the test proves nothing"
    _assert_kernels_ran(result, run)
    layers = 2
    assert result["calls"]["causal_lm_loss"] == 3 and result["calls"]["residual_rms_norm"] == 3 * layers, (
        f"{run}: the kernels did not run: {result['calls']}")
    assert_losses_equal(result["losses"], eager["losses"], rtol=1e-5, what=run)
    for name, grad in eager["grads"].items():
        assert result["grads"][name] is not None, f"{run}: no gradient for {name}"
        actual, expected = torch.tensor(result["grads"][name]), torch.tensor(grad)
        error = float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
        assert error <= 1e-4, f"{run}: gradient of {name} differs by {error:.2e} relative"
    assert not result["gathered_after_step"], f"{run}: left gathered after the step: {result['gathered_after_step']}"
    # Gathered where lm_head's and the norm's own hooks gather them, not for a whole enclosing module's forward.
    assert not result["external_parameters"], f"{run}: {result['external_parameters']}"


def test_accelerate_before_and_after_prepare(tmp_path):
    runs = _run("accelerate", tmp_path)
    for order in ("before", "after"):
        result = runs[order]
        assert result["wrapper"] == "DeepSpeedEngine", f"accelerate wrapped in {result['wrapper']}"
        _assert_kernels_ran(result, f"accelerate, kernelized {order} prepare")
        assert result["calls"]["causal_lm_loss"] == 3
        assert_losses_equal(result["losses"], runs["eager"]["losses"], rtol=1e-5, what=f"accelerate {order}")


@pytest.mark.parametrize("stage", [3, 2])
def test_trainer_with_kernelize_callback(tmp_path, stage):
    runs = _run(f"trainer{stage}", tmp_path)
    plain = runs["plain"]
    assert plain["wrapper"] == "DeepSpeedEngine"
    assert plain["partitioned_at_load"] is (stage == 3), "ZeRO-3 loads the model under zero.Init"
    # The loss and the residual norm kernels: the portable ones (no RoPE kernel on the CPU).
    checks = {"callback": plain, "late": plain} if stage == 3 else {"callback": plain}
    if stage == 3:
        assert runs["before"]["partitioned_at_load"] is False
        checks["before"] = runs["plain-before"]
    for which, expected in checks.items():
        _assert_kernels_ran(runs[which], f"ZeRO-{stage} Trainer, {which}")
        assert_losses_equal(runs[which]["losses"], expected["losses"], what=f"ZeRO-{stage} Trainer, {which}")
    assert "kernels-core's fused loss" in runs["callback"]["loss_owner"], runs["callback"]["loss_owner"]
