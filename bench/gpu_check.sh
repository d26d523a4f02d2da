#!/usr/bin/env bash
# One script for a machine with a CUDA GPU: build with CUDA, run the tests marked `gpu`,
# run the quick benchmark suite on the GPU, and leave logs and JSON in one folder.
#   bash bench/gpu_check.sh [OUT_DIR]     (default bench/results/<gpu>-<date>/)
# Budget: under 8 minutes on one H200 (each step below has its own time limit).
set -uo pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_' || true)
out=${1:-bench/results/${gpu:-gpu}-$(date +%Y%m%d)}
mkdir -p "$out"
export DISTLLM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$out/summary.log"; }

PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
log "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)' 2>&1)"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

log "build (pip install --no-build-isolation -e .)"
timeout 240 $PY -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
log "build rc=$?"

$PY -m distllm info --json > "$out/info.json" 2>>"$out/summary.log"

log "gpu tests"
timeout 150 $PY -m pytest -m gpu -q -x --timeout 120 --junitxml="$out/gpu_tests.xml" tests \
  > "$out/gpu_tests.log" 2>&1
log "gpu tests rc=$? ($(tail -1 "$out/gpu_tests.log"))"

log "distllm bench --quick --device cuda"
timeout 180 $PY -m distllm bench --quick --device cuda --dtype bfloat16 --out "$out/bench" \
  > "$out/bench.log" 2>&1
log "bench rc=$?"
log "done: $out"
