"""Running a worker script (``distributed_workers/``) in a subprocess for a test: one way to stop it and to fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


def run_worker(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``cmd`` and return its stdout; fail the test, with the ends of both streams, if it exits non-zero or
    outlives ``timeout`` seconds. SIGTERM comes first: torchrun forwards it to its workers and waits for them (a
    SIGKILL would orphan them, still holding the GPUs the next test needs)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s\n--- stdout\n{stdout[-8000:]}\n"
                    f"--- stderr\n{stderr[-8000:]}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{stdout[-8000:]}\n"
                    f"--- stderr\n{stderr[-12000:]}", pytrace=False)
    return stdout
