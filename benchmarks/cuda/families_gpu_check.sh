#!/usr/bin/env bash
# On one NVIDIA GPU (H100/H200): the GPU tests of the family sweep's kernels and the models_bench rows of its shapes.
# Usage (repository root): OUT=/tmp/out bash benchmarks/cuda/families_gpu_check.sh
# Writes $OUT/pytest-families.txt (plugins-cuda/tests/test_families_gpu.py: Granite, Gemma 2/3, DeepSeek-V3 MLA,
# GLM-4, ERNIE 4.5, Cohere through kernels-cuda against eager; test_e2e_gpu.py, whose Gemma 2/3 layers now fuse the
# residual add; triton-adapters' test_loss.py with the scaled loss through Liger), $OUT/families-bench.json (+ .png):
# models_bench on granite-3-8b-4l and deepseek-v2-lite-4l, eager / liger / kernelize / compile / kernelize_compile,
# 2 x 4096 tokens, 2 rounds), and $OUT/log.txt. Knobs: BENCH_VARIANTS, BENCH_ARGS (e.g. --rounds 3), TEST_TIMEOUT.
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (liger-kernel), as gpu_run.sh installs them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/core/src:$PWD/triton-adapters/src:$PWD/plugins-cuda/src:$PWD
# Entry points exist only for installed distributions: without them kernelize would find no CUDA plugin.
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e core -e triton-adapters -e plugins-cuda \
  || { echo "editable install failed"; exit 1; }
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
log "tests"
timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider plugins-cuda/tests/test_families_gpu.py \
  plugins-cuda/tests/test_e2e_gpu.py triton-adapters/tests/test_loss.py 2>&1 | tee "$OUT/pytest-families.txt" | tail -30
log "models_bench"
timeout 3000 python3 -m benchmarks.cuda.models_bench --models granite-3-8b-4l,deepseek-v2-lite-4l \
  --variants "${BENCH_VARIANTS:-eager,liger,kernelize,compile,kernelize_compile}" ${BENCH_ARGS:---rounds 2} \
  --out "$OUT/families-bench.json" 2>&1 | tee -a "$OUT/log.txt" | tail -40
log "done"
