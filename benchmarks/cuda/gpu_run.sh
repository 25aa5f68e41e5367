#!/usr/bin/env bash
# On a GPU machine: install the carried liger-kernel wheel, probe the machine, run the GPU tests and benchmarks.
# Usage (repository root, on the GPU machine): bash benchmarks/cuda/gpu_run.sh "<stages>" where stages is a
# space-separated subset of: probe report memory tests nox host rmsnorm sweep elementwise attention qwen3 portable
# llamafactory distributed (sweep: the RMSNorm backward's launch shapes, benchmarks.cuda.rmsnorm_tiling_sweep;
# llamafactory: benchmarks.cuda.llamafactory_bench with the wheels of .whl-lf/, knobs LF_ARGS and LF_TIMEOUT)
# Knobs: HOST_ARGS (e.g. --profile), RMSNORM_ARGS (e.g. --shapes 8192x1024 --chain-only --rounds 3), RMSNORM_TIMEOUT (default 540 s; the full sweep times 5 rounds of chains), SWEEP_TIMEOUT, ATTENTION_ARGS (e.g. --no-flex), ATTENTION_TIMEOUT, MEMORY_VARIANTS, QWEN3_VARIANTS, QWEN3_ARGS (e.g. --profile), QWEN3_TIMEOUT, TEST_PKGS, TEST_PATHS
# (pytest paths inside each package, default tests), TEST_TIMEOUT, PYTEST_ARGS, EXTRA_PYTHONPATH (searched first, e.g. another
# transformers installed with pip --target).
# distributed (needs 2+ GPUs): plugins-cuda/tests/test_distributed_gpu.py (kernelize under FSDP2, DDP, device_map,
# tensor parallel, the Trainer's callback under accelerate FSDP2/DDP; 2-D FSDP2 x TP with 4+ GPUs; each check a
# torchrun or python subprocess; output in $OUT/pytest-distributed.txt), then distributed_bench --nprocs at 1 and
# every GPU (FSDP2 scaling, $OUT/distributed.json + .png) and trainer_bench --gpus N (the Trainer under FSDP2,
# $OUT/trainer-fsdp2.json). Knobs: DIST_TEST_TIMEOUT (default 480 s), DIST_BENCH_TIMEOUT (330 s), DIST_NPROCS
# (default "1,<GPUs>"), DIST_VARIANTS (default eager,kernelize_before,kernelize_after), DIST_BENCH_ARGS (e.g.
# --model qwen3-30b-a3b-4l --batch 2 --seq 4096). NVLink SHARP / multicast stay off (NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) unless set.
set -u
STAGES="${1:-probe tests rmsnorm qwen3}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/cuda/gpu_setup.sh || exit 1
if [[ " $STAGES " == *" probe "* ]]; then
  log probe
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
    python3 -c "import torch,triton,transformers,liger_kernel,importlib.metadata as m;print(torch.__version__,torch.version.cuda,triton.__version__,transformers.__version__,m.version('liger-kernel'))";
    python3 -c "import importlib.metadata as m; print('entry points:', [e.name for e in m.entry_points(group='kernels_core.plugins')])";
  } 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" report "* ]]; then
  log report
  timeout 90 python3 -m benchmarks.cuda.kernelize_report 2>&1 | tee -a "$OUT/log.txt" | tail -60
fi
if [[ " $STAGES " == *" memory "* ]]; then
  log memory
  timeout 300 python3 -m benchmarks.cuda.memory_breakdown --out "$OUT/cuda-memory.json" \
    --variants "${MEMORY_VARIANTS:-eager,liger,kernelize}" 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" tests "* ]]; then
  log tests
  for pkg in ${TEST_PKGS:-plugins-cuda triton-adapters}; do
    (cd $pkg && timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs --tb=short ${TEST_PATHS:-tests} -p no:cacheprovider) 2>&1 \
      | tee -a "$OUT/pytest.txt" | tail -25
  done
fi
if [[ " $STAGES " == *" nox "* ]]; then
  # The README's own command for the CUDA package, run on this machine's Python (no venv: nothing to download
  # here). nox and its few dependencies travel as wheels under .whl/nox.
  log nox
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/noxsite .whl/nox/*.whl \
    && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; } \
    && PYTHONPATH=/tmp/noxsite:$PYTHONPATH timeout ${TEST_TIMEOUT:-540} python3 -m nox --no-venv --no-install \
         -s "tests(vendor='cuda')" -- -q --tb=short ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/nox-cuda.txt" | tail -40
fi
if [[ " $STAGES " == *" host "* ]]; then
  log host
  timeout 240 python3 -m benchmarks.cuda.host_overhead_bench --out "$OUT/cuda-host-overhead.json" ${HOST_ARGS:-} \
    2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" rmsnorm "* ]]; then
  log rmsnorm
  timeout ${RMSNORM_TIMEOUT:-540} python3 -m benchmarks.cuda.rmsnorm_bench --out "$OUT/cuda-rmsnorm.json" ${RMSNORM_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" sweep "* ]]; then
  log sweep
  timeout ${SWEEP_TIMEOUT:-300} python3 -m benchmarks.cuda.rmsnorm_tiling_sweep --out "$OUT/cuda-rmsnorm-tiling.json" 2>&1 \
    | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" elementwise "* ]]; then
  log elementwise
  timeout 180 python3 -m benchmarks.cuda.elementwise_bench --out "$OUT/cuda-elementwise.json" 2>&1 \
    | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" attention "* ]]; then
  log attention
  timeout ${ATTENTION_TIMEOUT:-240} python3 -m benchmarks.cuda.attention_bench --out "$OUT/cuda-attention.json" \
    ${ATTENTION_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" qwen3 "* ]]; then
  log qwen3
  timeout ${QWEN3_TIMEOUT:-400} python3 -m benchmarks.cuda.qwen3_bench --out "$OUT/cuda-qwen3.json" \
    --variants "${QWEN3_VARIANTS:-eager,liger,torch_compile,kernelize,kernelize_compile}" ${QWEN3_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" llamafactory "* ]]; then
  # LLaMA-Factory v1 and what it imports beyond the GPU image (its transformers pin, <= 5.6, included), carried as
  # wheels under .whl-lf/ and installed apart from .whl/ (two versions of datasets would stop one install).
  log llamafactory
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-lf \
    .whl-lf/*.whl && PYTHONPATH=/tmp/site-lf:$PYTHONPATH timeout ${LF_TIMEOUT:-420} \
    python3 -m benchmarks.cuda.llamafactory_bench --out "$OUT/llamafactory.json" ${LF_ARGS:-} 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" portable "* ]]; then
  log portable
  timeout 300 python3 -m benchmarks.portable.memory --device cuda --shape qwen3-0.6b \
    --out "$OUT/portable-cuda-qwen3-0.6b.json" 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ " $STAGES " == *" distributed "* ]]; then
  log distributed
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" \
    NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 | tee -a "$OUT/log.txt"
  gpus=$(nvidia-smi -L | wc -l)
  (cd plugins-cuda && timeout ${DIST_TEST_TIMEOUT:-480} python3 -m pytest -q -rs --tb=short tests/test_distributed_gpu.py \
     -p no:cacheprovider ${PYTEST_ARGS:-}) 2>&1 | tee -a "$OUT/pytest-distributed.txt" | tail -60
  timeout ${DIST_BENCH_TIMEOUT:-330} python3 -m benchmarks.cuda.distributed_bench --nprocs "${DIST_NPROCS:-1,$gpus}" \
    --variants "${DIST_VARIANTS:-eager,kernelize_before,kernelize_after}" --out "$OUT/distributed.json" \
    ${DIST_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | tail -40
  timeout ${DIST_BENCH_TIMEOUT:-330} python3 -m benchmarks.cuda.trainer_bench --gpus "$gpus" \
    --variants plain,liger,kernelize --out "$OUT/trainer-fsdp2.json" 2>&1 | tee -a "$OUT/log.txt" | tail -20
fi
log done
