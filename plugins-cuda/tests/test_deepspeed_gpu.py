"""transformers' Trainer under DeepSpeed ZeRO-2 and ZeRO-3 with kernels-core on GPUs: ``KernelizeCallback`` (before
the engine, and added late: after it) and ``kernelize`` before the Trainer, against the plain Trainer.

Each case runs ``distributed_workers/deepspeed_worker.py`` in a subprocess: plain Python on one GPU (the worker
sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` itself), ``torchrun --standalone
--nproc_per_node 2`` on two. 20 steps per Trainer; every logged loss within 1e-3 relative of the plain run's in
float32 (2e-2 in bfloat16); the fused loss and the residual add + norm applied (they read ``lm_head`` /
``post_attention_layernorm`` weights that ZeRO-3 partitions; the worker partitions every parameter, norms
included, with ``stage3_param_persistence_threshold`` 0). The worker prints tokens/s and peak memory per run.

Skipped without a CUDA GPU or without deepspeed. With ``KERNELS_CPU_DISTRIBUTED=1`` the same worker also runs on
DeepSpeed's CPU accelerator (gloo; one and two processes, 2 steps). The engine-level and accelerate checks on the
CPU are ``core/tests/integrations/test_deepspeed.py``; without deepspeed, ``core/tests/kinds/test_zero3.py``.
``KERNELS_DIST_WORKER_TIMEOUT`` (seconds, default 600) bounds each worker.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from worker_run import run_worker


WORKERS = Path(__file__).parent / "distributed_workers"
TIMEOUT_S = int(os.environ.get("KERNELS_DIST_WORKER_TIMEOUT", "600"))


def _skip_reason(gpus: int) -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} NVIDIA GPUs; this machine has {torch.cuda.device_count()}"
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'kernels-core[deepspeed]', or carry its wheel)"
    if gpus > 1 and not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def _run(args: list[str], gpus: int, *, cpu: bool = False) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]
    cmd = [*(launcher if gpus > 1 else [sys.executable]), "deepspeed_worker.py", *args]
    env = dict(os.environ)
    # NVLink SHARP / multicast stay off (the lent hosts' rule); the worker sets the same defaults.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("OMP_NUM_THREADS", "1" if cpu else "4")
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run_worker(cmd, cwd=WORKERS, env=env, timeout=TIMEOUT_S)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [3, 2], ids=["zero3", "zero2"])
@pytest.mark.parametrize("gpus", [1, 2], ids=["1gpu", "2gpu"])
def test_trainer_under_deepspeed(gpus, stage, dtype):
    if reason := _skip_reason(gpus):
        pytest.skip(reason)
    stdout = _run(["--stage", str(stage), "--dtype", dtype], gpus)
    print(stdout[-4000:])
    assert ": OK;" in stdout, stdout


@pytest.mark.parametrize("gpus", [1, 2])
def test_worker_on_cpu(gpus):
    """The same worker on DeepSpeed's CPU accelerator over gloo (2 steps, ZeRO-3; one or two processes): set
    KERNELS_CPU_DISTRIBUTED=1 to run it (about a minute each on a 2-core CPU)."""
    if os.environ.get("KERNELS_CPU_DISTRIBUTED") != "1":
        pytest.skip("CPU variant: set KERNELS_CPU_DISTRIBUTED=1 to run it (about a minute)")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'kernels-core[deepspeed]')")
    if not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo")
    stdout = _run(["--device", "cpu", "--stage", "3", "--steps", "2"], gpus, cpu=True)
    assert ": OK;" in stdout, stdout


def test_worker_parses_arguments():
    """On any machine: the worker imports (without deepspeed) and parses its arguments."""
    proc = subprocess.run([sys.executable, "deepspeed_worker.py", "--help"], cwd=WORKERS, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--stage" in proc.stdout
