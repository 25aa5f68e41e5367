#!/usr/bin/env bash
# On one H200 (or H100): the floor accounting, FP8 at full depth and FSDP2's host tax (issue 51). Repository root,
# wheels carried under .whl/ (liger-kernel, torchao 0.17); results (JSON, charts, log) go to $OUT.
# Usage: STAGES="probe floor fsdp2" bash benchmarks/cuda/floor_fp8_fsdp2_gpu.sh
# Stages (each with its own timeout, so one that runs long leaves the others' files):
#   probe     GPU, versions, entry points
#   floor     models_bench on qwen3-0.6b, llama-3.1-8b-4l, gemma-3-4b-6l (FLOOR_VARIANTS, default kernelize,
#             kernelize_compile), 2 x 4096 tokens, --profile: every row with floor_ms / floor_fraction and where the
#             rest goes                                                               -> $OUT/floor-models.json
#   fsdp2     distributed_bench on 1 GPU, Qwen3-0.6B shape, one FSDP2 unit per decoder layer, foreach AdamW,
#             --rounds 3 alternating: eager, kernelize before / after fully_shard, per-layer compile before
#             fully_shard with and without kernelize (before / after), prefetch of 2 layers
#                                                                                    -> $OUT/fsdp2-1gpu.json
#   fp8       models_bench on llama-3.1-8b (32 layers), activation checkpointing in every variant, 2 x 4096
#             tokens: kernelize_compile against FP8 tensorwise / rowwise, lm_head in FP8 or not; FP8_COMPILE_LAYERS=1
#             compiles each decoder layer alone (every variant alike)                  -> $OUT/fp8-full-depth.json
#   accuracy  fp8_accuracy at ACC_LAYERS (default 16) layers (ACC_CHECKPOINTING=1: with checkpointing), ACC_STEPS
#             (300) steps, one process per variant (ACC_VARIANTS, default "bf16 fp8_tensorwise")
#                                                                                      -> $OUT/fp8-accuracy.json
# Knobs: STAGES (default "probe floor fsdp2"), FLOOR_VARIANTS, FLOOR_TIMEOUT (300 s), FSDP2_VARIANTS, FSDP2_TIMEOUT
# (240 s), FP8_VARIANTS, FP8_TIMEOUT (540 s), ACC_LAYERS, ACC_STEPS, ACC_VARIANTS, ACC_TIMEOUT (270 s per variant),
# ACC_ARGS (more fp8_accuracy options, e.g. "--lr 1e-4 --warmup 60": at 16 layers lr 3e-4 learned 3% of the task in
# 300 steps).
# Every results file is rewritten after each row or variant, so a stage cut by its timeout keeps what it measured
# (fp8_accuracy: each finished variant).
# NVLink SHARP / multicast stay off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).
# SMOKE=1: the same commands on the CPU with tiny models and one or two steps, in the current environment (no wheel
# or editable install), to check the script anywhere: SMOKE=1 OUT=/tmp/smoke STAGES="floor fsdp2 fp8 accuracy" bash ...
set -u
STAGES="${STAGES:-probe floor fsdp2}"
OUT="${OUT:-/tmp/out}"
if [[ -n "${SMOKE:-}" ]]; then
  mkdir -p "$OUT"
  log() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
  # Later options win: these replace the sizes below.
  MODELS_SMOKE="--device cpu --tiny --tokens 1x64 --steps 1 --warmup 1"
  DIST_SMOKE="--device cpu --tiny --steps 1 --warmup 1 --rounds 1"
  ACC_SMOKE="--tiny"
else
  source benchmarks/cuda/gpu_setup.sh || exit 1
  MODELS_SMOKE="" DIST_SMOKE="" ACC_SMOKE=""
fi
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" \
  NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
# The benchmarks' per-process scratch files stay here; only the results are copied to $OUT (8 files come back).
WORK="${WORK:-/tmp/floor-fp8-fsdp2}"; mkdir -p "$WORK"
keep() { for f in "$@"; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has probe; then
  log probe
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
    python3 -c "import torch,triton,transformers,importlib.metadata as m;print(torch.__version__,torch.version.cuda,triton.__version__,transformers.__version__,m.version('liger-kernel'),m.version('torchao'))";
    python3 -c "import importlib.metadata as m; print('entry points:', [e.name for e in m.entry_points(group='kernels_core.plugins')])";
    git log --oneline -1 2>/dev/null;
  } 2>&1 | tee -a "$OUT/log.txt"
fi
if has floor; then
  log floor
  timeout "${FLOOR_TIMEOUT:-300}" python3 -m benchmarks.cuda.models_bench --models qwen3-0.6b,llama-3.1-8b-4l,gemma-3-4b-6l \
    --variants "${FLOOR_VARIANTS:-kernelize,kernelize_compile}" --tokens 2x4096 --steps 6 --warmup 2 --profile \
    --timeout 200 --out "$WORK/floor-models.json" $MODELS_SMOKE 2>&1 | grep --line-buffered -v '^{' | tee -a "$OUT/log.txt"
  keep "$WORK/floor-models.json"
fi
if has fsdp2; then
  log fsdp2
  timeout "${FSDP2_TIMEOUT:-240}" torchrun --standalone --nproc_per_node 1 -m benchmarks.cuda.distributed_bench \
    --variants "${FSDP2_VARIANTS:-eager,kernelize_before,kernelize_after,compile,kernelize_compile,kernelize_compile_after,kernelize_before+prefetch2,kernelize_after+prefetch2}" \
    --optimizer foreach --rounds 3 --steps 8 --warmup 3 --out "$WORK/fsdp2-1gpu.json" $DIST_SMOKE 2>&1 \
    | grep --line-buffered -v -E '^ +declined|^  [a-z_+0-9]+: ' | tee -a "$OUT/log.txt" | tail -40
  keep "$WORK/fsdp2-1gpu.json"
fi
if has fp8; then
  log fp8
  timeout "${FP8_TIMEOUT:-540}" python3 -m benchmarks.cuda.models_bench --models llama-3.1-8b --checkpointing \
    ${FP8_COMPILE_LAYERS:+--compile-layers} \
    --variants "${FP8_VARIANTS:-kernelize_compile,fp8_tensorwise,fp8_tensorwise+lm_head,fp8_rowwise}" --tokens 2x4096 \
    --steps 4 --warmup 1 --timeout 260 --out "$WORK/fp8-full-depth.json" $MODELS_SMOKE 2>&1 | grep --line-buffered -v '^{' | tee -a "$OUT/log.txt"
  keep "$WORK/fp8-full-depth.json"
fi
if has accuracy; then
  log accuracy
  # One command per variant: fp8_accuracy keeps an earlier variant's row of the same settings, so a variant cut
  # by its timeout leaves the others'.
  for variant in ${ACC_VARIANTS:-bf16 fp8_tensorwise}; do
    timeout "${ACC_TIMEOUT:-270}" python3 -m benchmarks.cuda.fp8_accuracy --layers "${ACC_LAYERS:-16}" \
      ${ACC_CHECKPOINTING:+--checkpointing} \
      --steps "${ACC_STEPS:-300}" --variants "$variant" --timeout "${ACC_TIMEOUT:-270}" --out "$WORK/accuracy" \
      ${ACC_ARGS:-} $ACC_SMOKE \
      2>&1 \
      | tail -25 | tee -a "$OUT/log.txt"
  done
  keep "$WORK/accuracy/fp8-accuracy.json" "$WORK/accuracy/fp8-accuracy.png"
fi
log done
