#!/usr/bin/env bash
# On one NVIDIA GPU (H100/H200), about 6 minutes: the GPU checks of issue 48's family work, results as JSON.
# Usage (repository root): bash benchmarks/cuda/families_gpu_check.sh      (OUT defaults to /tmp/out)
#
# 1. tests (TEST_TIMEOUT, default 150 s): plugins-cuda/tests/test_families_gpu.py (every layout the family sweep
#    added, through kernels-cuda against eager in fp32/bf16), the loss tests (triton-adapters' test_loss.py, with
#    the scaled loss's stated bf16 bound, test_loss_chunks.py, and test_liger_gpu.py -k loss). Writes
#    $OUT/pytest-families.txt and $OUT/families-tests.json (per test: outcome, seconds, message).
# 2. models_bench (BENCH_TIMEOUT per shape, default 300 s): granite-3-8b-4l and deepseek-v2-lite-4l, variants
#    eager / liger / kernelize / compile / kernelize_compile, 2 x 4096 tokens, one round of 6 timed steps after 2
#    warm-up steps, no floor accounting (BENCH_ARGS replaces those settings, e.g. "--rounds 2 --steps 8").
#    Writes $OUT/families-bench-<shape>.json (+ .png).
# $OUT/log.txt has the stage times. Carried wheels under .whl/ (liger-kernel) are installed first, as gpu_run.sh
# does; without liger-kernel the liger variant and the Liger loss tests report why they did not run.
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  source benchmarks/cuda/gpu_setup.sh || exit 1
else
  export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$PWD/core/src:$PWD/triton-adapters/src:$PWD/plugins-cuda/src
  # Entry points exist only for installed distributions: without them kernelize would find no CUDA plugin.
  python3 -m pip install --no-deps --no-build-isolation --no-index -q -e core -e triton-adapters -e plugins-cuda \
    || { echo "editable install failed"; exit 1; }
  log() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
fi
export PYTHONPATH=$PYTHONPATH:$PWD
log "tests"
{
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/families-tests-1.xml" \
    plugins-cuda/tests/test_families_gpu.py triton-adapters/tests/test_loss.py triton-adapters/tests/test_loss_chunks.py
  timeout 90 python3 -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/families-tests-2.xml" \
    triton-adapters/tests/test_liger_gpu.py -k loss
} 2>&1 | tee "$OUT/pytest-families.txt" | tail -30
python3 - "$OUT" <<'EOF'
import json, pathlib, sys, xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
rows = []
for path in sorted(out.glob("families-tests-*.xml")):
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], (
                    node.get("message") or "")[:500]
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0), "message": message})
totals = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
(out / "families-tests.json").write_text(json.dumps({"totals": totals, "tests": rows}, indent=1))
print("families-tests.json:", totals)
EOF
for shape in granite-3-8b-4l deepseek-v2-lite-4l; do
  log "models_bench $shape"
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.cuda.models_bench --models "$shape" \
    --variants eager,liger,kernelize,compile,kernelize_compile ${BENCH_ARGS:---rounds 1 --steps 6 --warmup 2 --no-floor} \
    --out "$OUT/families-bench-$shape.json" 2>&1 | tee -a "$OUT/log.txt" | tail -20
done
log "done"
