"""``benchmarks/cuda/llamafactory_bench.py`` end to end on the CPU (``--tiny``): LLaMA-Factory v1's SFT trainer on
packed rows (``dynamic_padding_free``), with and without the kernels_core ``KernelPlugin``, each in its own process,
as the GPU measurement runs it. Both train on the same rows and log the same losses (LLaMA-Factory's all-ones mask
makes sdpa attend across documents, with the plugin or without)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.skipif(not (REPO / "benchmarks" / "cuda" / "llamafactory_bench.py").is_file(),
                                reason="needs the source repository's benchmarks/")


def test_bench_trains_both_variants_on_the_same_packed_rows(tmp_path):
    out = tmp_path / "lf.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.cuda.llamafactory_bench", "--tiny", "--device", "cpu",
                           "--steps", "3", "--warmup", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    plain, kernels = data["results"]["plain"], data["results"]["kernels"]
    assert "error" not in plain and "error" not in kernels, data["results"]
    # 4 samples cut at 64 tokens, packed into one row a step.
    assert plain["tokens_per_step"] == kernels["tokens_per_step"] == [256] * 3
    assert plain["kernelize"] is None
    assert "packed_attention" in kernels["kernelize"] and "causal_lm_loss" in kernels["kernelize"]
    assert len(plain["losses"]) == len(kernels["losses"]) == 3
    assert data["summary"]["max_rel_loss_gap"] <= 1e-5
    assert kernels["steady_tokens_per_second"] > 0 and plain["steady_tokens_per_second"] > 0
