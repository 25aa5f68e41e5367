# Sourced (not run) at the start of the GPU scripts, from the repository root on the GPU machine: installs the wheels
# carried under .whl/ (liger-kernel, torchao) into /tmp/site, the repository's packages in editable mode (their entry
# points), and defines log(). Needs OUT set; EXTRA_PYTHONPATH (optional) is searched first. Returns 1 on failure.
# Once done it exports GPU_SETUP_DONE=1: scripts started from that shell (one per GPU, side by side) skip the
# installs, which would otherwise rewrite the same files at the same time.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
log() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
[[ -n "${GPU_SETUP_DONE:-}" ]] && return 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; return 1; }
# Byte-compile now, warnings silenced: a carried package's invalid escape sequences (torchao 0.17) would otherwise
# be compiled on first import inside the test suites, whose warnings are errors, and fail every test importing it.
python3 -W ignore -m compileall -q /tmp/site > /dev/null 2>&1 || true
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}/tmp/site:$PWD/core/src:$PWD/triton-adapters/src:$PWD/plugins-cuda/src
# Entry points exist only for installed distributions: without this, kernelize would find no CUDA plugin.
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e core -e triton-adapters -e plugins-cuda \
  || { echo "editable install failed"; return 1; }
export GPU_SETUP_DONE=1
