"""Run a worker script on two CPU processes (gloo) under torch.distributed.run and collect each rank's JSON;
``finish`` ends a worker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(worker: Path, scenario: str, out: Path) -> list[dict]:
    """Run ``worker scenario out`` on two ranks; each rank writes ``out/<scenario>-rank<r>.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(worker), scenario, str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{scenario} workers failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(2)]


def finish(out: Path, scenario: str, rank: int, result: dict) -> None:
    """In a worker: write this rank's result, wait for the other rank, and leave (never returns)."""
    import torch.distributed as dist

    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Every result is on disk. Now and then (1 in 8 runs on torch 2.13's CPU build) a gloo thread still joinable
    # at the interpreter's teardown aborts the process ("terminate called without an active exception"); leaving
    # without that teardown keeps the exit status about the checks alone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
