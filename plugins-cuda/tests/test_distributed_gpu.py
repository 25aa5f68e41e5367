"""kernelize under FSDP2, DDP, accelerate's device_map and transformers tensor parallelism, PEFT LoRA under FSDP2,
and the Trainer's ``KernelizeCallback`` under accelerate's FSDP2 and DDP, on two GPUs; FSDP2 x tensor parallelism
(2-D) on four.

Each check is a worker script under ``distributed_workers/`` run in a subprocess: ``torchrun --standalone
--nproc_per_node 2`` (4 for the 2-D one) for the process-group ones, plain Python for ``device_map`` (one process,
two GPUs). A worker asserts and exits non-zero on failure, printing the kernelize report; its output is shown here
on failure. The GPU tests skip unless torch sees two CUDA GPUs (four for 2-D) and NCCL.

The same workers run on CPU over gloo (``--device cpu``; device_map then attaches accelerate's hooks with
``dispatch_model(force_hooks=True)``): set ``KERNELS_CPU_DISTRIBUTED=1`` to run those variants too (20-60 s each
on a 2-core CPU). Without it, only each worker's ``--help`` runs on CPU: the scripts import and parse. The 2-D
worker's CPU variant (four gloo processes, about 20 s on 2 cores) runs always, CI included. The Trainer worker is
GPU only: its CPU/gloo version is ``core/tests/integrations/test_trainer_distributed.py``.
``KERNELS_DIST_WORKER_TIMEOUT`` (seconds, default 180) bounds each worker.
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
# Per worker. On two H200s a worker takes well under a minute (Triton compiles included); the distributed stage of
# benchmarks/cuda/gpu_run.sh (DIST_TEST_TIMEOUT) must leave room for all four.
TIMEOUT_S = int(os.environ.get("KERNELS_DIST_WORKER_TIMEOUT", "180"))


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs two NVIDIA GPUs (CUDA build of torch); CI is CPU-only"
    if torch.cuda.device_count() < 2:
        return f"needs two NVIDIA GPUs; this machine has {torch.cuda.device_count()}"
    return None


def _launcher_skip_reason(device: str) -> str | None:
    if not torch.distributed.is_available():
        return "this torch build has no torch.distributed"
    if importlib.util.find_spec("torch.distributed.run") is None:
        return "torchrun (torch.distributed.run) is not available"
    if device == "cuda" and not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    if device == "cpu" and not torch.distributed.is_gloo_available():
        return "this torch build has no gloo"
    return None


def _skip_reason(device: str, *, distributed: bool) -> str | None:
    if device == "cuda":
        reason = _gpu_skip_reason()
    elif os.environ.get("KERNELS_CPU_DISTRIBUTED") != "1":
        reason = "CPU/gloo variant: set KERNELS_CPU_DISTRIBUTED=1 to run it (20-60 s)"
    else:
        reason = None
    return reason or (_launcher_skip_reason(device) if distributed else None)


def _run(args: list[str], *, torchrun: bool, nproc: int = 2, timeout: int = TIMEOUT_S) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd = [*(launcher if torchrun else [sys.executable]), *args]
    env = dict(os.environ)
    # NVLink SHARP / multicast off (they fail on the lent H200 hosts); the workers set the same defaults.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # torchrun's warning otherwise; the tiny models need no more, and four gloo ranks on 2 cores must not oversubscribe
    env.setdefault("OMP_NUM_THREADS", "2" if nproc <= 2 else "1")
    env["PYTHONUNBUFFERED"] = "1"
    if any(a == "--device" and b == "cpu" for a, b in zip(args, args[1:], strict=False)):
        # transformers >= 5.24 binds each TP rank to an accelerator whenever one is visible (device LOCAL_RANK): on
        # a one-GPU machine ranks 1-3 of the CPU/gloo variant would fail, so it sees no GPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run_worker(cmd, cwd=WORKERS, env=env, timeout=timeout)


DEVICES = ["cuda", "cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_kernelize_before_and_after_wrapping(device, wrapper):
    """FSDP2 (fully_shard per layer, then root) or DDP: the same kernels per module in either order, and losses
    equal to each other and to the eager wrapped model (fp32 and bf16)."""
    if reason := _skip_reason(device, distributed=True):
        pytest.skip(reason)
    stdout = _run(["train_worker.py", "--wrap", wrapper, "--device", device], torchrun=True)
    assert stdout.count(": OK;") == 2, stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_device_map_generate_and_unkernelize(device, dtype):
    """from_pretrained(device_map=...) over two GPUs: RoPE included, greedy tokens as eager, hooks restored.

    In float32 no divergence at all is tolerated (``--margin 0``): every greedy token equals eager's. In bfloat16
    a row may diverge only at a near-tie of eager's top two logits (see the worker's docstring).
    """
    if reason := _skip_reason(device, distributed=False):
        pytest.skip(reason)
    strict = ["--margin", "0"] if dtype == "float32" else []
    stdout = _run(["device_map_worker.py", "--device", device, "--dtype", dtype, *strict], torchrun=False)
    assert ": OK;" in stdout, stdout
    print(stdout[-2000:])


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_parallel_losses_match_eager(device):
    """tp_plan="auto": every matched module has a kernel or a reason, and loss and gradients match eager TP."""
    if reason := _skip_reason(device, distributed=True):
        pytest.skip(reason)
    stdout = _run(["tp_worker.py", "--device", device], torchrun=True)
    assert ": OK;" in stdout, stdout


@pytest.mark.parametrize("device", DEVICES)
def test_lora_under_fsdp2(device):
    """PEFT LoRA on every linear layer and lm_head, fully_shard per layer and on the PEFT model: kernelize before
    get_peft_model, between it and fully_shard, or last; losses and LoRA gradients equal plain PEFT + FSDP2's, and
    the fused loss trains lm_head's adapter."""
    if reason := _skip_reason(device, distributed=True):
        pytest.skip(reason)
    pytest.importorskip("peft", reason="the LoRA checks need PEFT (installed with kernels-cuda[test])")
    stdout = _run(["lora_worker.py", "--device", device], torchrun=True)
    assert stdout.count(": OK;") == 6, stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_trainer_callback_under_fsdp2_and_ddp(wrapper, dtype):
    """transformers' Trainer wraps the model itself (accelerate's FSDP2, or DDP) with KernelizeCallback: every
    expected kind applied, the fused loss owns the loss, 20 logged losses equal to the plain Trainer's. GPU only;
    the CPU/gloo version is core/tests/integrations/test_trainer_distributed.py."""
    if reason := _skip_reason("cuda", distributed=True):
        pytest.skip(reason)
    pytest.importorskip("accelerate")
    stdout = _run(["trainer_worker.py", "--wrap", wrapper, "--dtype", dtype], torchrun=True)
    assert ": OK;" in stdout, stdout


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_parallel_times_fsdp2(device):
    """(dp 2) x (tp 2) on four ranks: transformers TP over one mesh dimension, FSDP2 over the other. The parameters
    are sharded over both; every matched module has a kernel or a reason, norms and MLP get theirs; 5 AdamW steps'
    losses match the eager 2-D run's in float32 and bfloat16, whether kernelize runs before or after fully_shard
    (where transformers leaves a point between TP and FSDP2). The CPU variant runs without KERNELS_CPU_DISTRIBUTED:
    about 20 s with four gloo processes on 2 cores."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs four NVIDIA GPUs (CUDA build of torch); CI is CPU-only")
        if torch.cuda.device_count() < 4:
            pytest.skip(f"needs four NVIDIA GPUs; this machine has {torch.cuda.device_count()}")
    if reason := _launcher_skip_reason(device):
        pytest.skip(reason)
    dtypes = ["--dtype", "float32", "--dtype", "bfloat16"]
    stdout = _run(["tp_fsdp_worker.py", "--device", device, *dtypes], torchrun=True, nproc=4)
    assert stdout.count(": OK;") == 2, stdout


@pytest.mark.parametrize("worker", ["train_worker.py", "device_map_worker.py", "tp_worker.py", "trainer_worker.py",
                                    "tp_fsdp_worker.py", "lora_worker.py"])
def test_worker_scripts_parse_arguments(worker):
    """On any machine: the workers import (their shared helper included) and parse their arguments."""
    proc = subprocess.run([sys.executable, worker, "--help"], cwd=WORKERS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--device" in proc.stdout
