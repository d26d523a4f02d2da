#!/usr/bin/env bash
# The check for a machine with one CUDA GPU (written for an offline H200 with torch 2.11,
# Python 3.12 and nvcc 13.0; nothing is downloaded):
#   (a) build: pip install --no-build-isolation --no-deps -e . with the CUDA extension
#       (DISTLLM_BUILD_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0 unless set); if that fails, again
#       without it (the Triton kernels and the benchmark still run; the step is failed);
#   (b) the tests marked `gpu`, the files of few tests first, every one of them (no -x, a
#       file that fails to import does not stop the others), each with a per-test timeout,
#       Triton tuning cut to one configuration (DISTLLM_TRITON_TUNE=min); a skipped test
#       fails the step (a GPU test that did not run is no result);
#   (c) the GPU benchmark (python -m distllm.bench.gpu_bench), the measurements that
#       compile nothing first.
# Every step runs even when an earlier one failed; the whole check fits in 8 minutes.
#
#   bash bench/gpu_check.sh OUT_DIR
#
# OUT_DIR gets at most 8 files: summary.log (one line per step), gpu_tests.xml (JUnit),
# results.json (benchmark rows + machine), info.json (distllm info), logs.tgz (full logs).
# They are removed first, so a reused OUT_DIR holds only this run's files. A step that runs
# out of time gets SIGINT (then SIGKILL 20 s later): pytest still writes the JUnit file of
# the tests that ran, and the benchmark's results.json holds every measurement it finished
# (it is rewritten after each one; "complete": false says some are missing); logs.tgz is
# rewritten after each step, so that a check killed outright still returns its logs.
# Environment: PY (the interpreter; default .venv/bin/python if present, else python3),
# TORCH_CUDA_ARCH_LIST, MAX_JOBS (default: all cores), GPU_CHECK_BUILD_TIMEOUT (seconds;
# default 180 with a GPU, 3600 without one, where the check is a rehearsal of the build).
#
# Exit codes: 0 every step passed; 1 a step failed (see summary.log); 2 usage error;
# 3 no CUDA GPU is visible: the CUDA extension was built and the check stopped before the
# GPU tests (the expected outcome of a rehearsal on a machine without a GPU).
set -uo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash bench/gpu_check.sh OUT_DIR   (OUT_DIR receives summary.log, gpu_tests.xml, results.json, info.json, logs.tgz)" >&2
  exit 2
fi
out=$1
cd "$(dirname "$0")/.."
mkdir -p "$out" || { echo "gpu_check: cannot create OUT_DIR $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_logs.XXXXXX")
outputs=(summary.log gpu_tests.xml results.json results.json.tmp info.json logs.tgz)
for f in "${outputs[@]}"; do rm -f "$out/$f"; done

start=$(date +%s)
deadline=$((start + 470))  # 8 minutes minus the packing of logs
failed=0
say() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*" >> "$out/summary.log"; }
left() { echo $(( deadline - $(date +%s) )); }
# budget WANT RESERVE: WANT seconds, or less so that RESERVE seconds stay for later steps
budget() { local b=$(( $(left) - $2 )); [ "$b" -gt "$1" ] && b=$1; [ "$b" -lt 10 ] && b=10; echo "$b"; }
snap() { tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null; }  # after each step
pack() { snap; rm -rf "$logs"; }
trap pack EXIT
# rc of a step under `timeout`: 124 (or 137 after the SIGKILL) is its time limit
rcs() { case $1 in 124|137) echo "$1 (timed out)";; *) echo "$1";; esac; }

if [ -z "${PY:-}" ]; then
  PY=python3
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
fi
# the interpreter's own bin first: the build finds the ninja (and nvcc wrappers) installed
# beside it, as an activated virtualenv would (torch builds one source at a time without ninja)
if pyexe=$(command -v "$PY"); then export PATH="$(cd "$(dirname "$pyexe")" && pwd):$PATH"; fi
export DISTLLM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1 DISTLLM_TRITON_TUNE=min
# offline, one machine: no pip version check; gloo and NCCL on the loopback
export PIP_DISABLE_PIP_VERSION_CHECK=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
say "nvcc: $(timeout 60 nvcc --version 2>&1 | grep -i release || echo 'not found on PATH')"
say "python: $(timeout 60 $PY -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
# the tests' package must be this tree's (an installed package named `tests` would win)
say "tests package: $(timeout 60 $PY -c 'import importlib.util as u; s = u.find_spec("tests"); print(s.origin if s else None)' 2>&1 | tail -1)"
timeout 60 nvidia-smi > "$logs/nvidia-smi.txt" 2>&1 || true
timeout 60 $PY -m pip freeze > "$logs/pip-freeze.txt" 2>&1 || true

gpu=0
cuda=$(timeout 120 $PY -c 'import torch; print(torch.cuda.is_available(), torch.cuda.device_count())' 2>&1 | tail -1)
say "torch.cuda: available, devices = $cuda"
[ "${cuda%% *}" = True ] && gpu=1

# (a) build -----------------------------------------------------------------------------------
# 3 minutes on the GPU machine; without a GPU (a rehearsal) only the build runs, given an hour
t=${GPU_CHECK_BUILD_TIMEOUT:-$([ $gpu -eq 1 ] && budget 180 280 || echo 3600)}
say "build: pip install --no-build-isolation --no-deps -e . (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS, timeout ${t}s)"
timeout "$t" $PY -m pip install --no-build-isolation --no-deps -e . > "$logs/build.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
  # without the CUDA extension: distllm.kernels and distllm.bench exist only installed
  say "build rc=$(rcs $rc): installing again without the CUDA extension"
  DISTLLM_BUILD_CUDA=0 timeout "$(budget 120 240)" $PY -m pip install --no-build-isolation \
    --no-deps -e . > "$logs/build_without_cuda.log" 2>&1
  say "build without the CUDA extension rc=$(rcs $?)"
fi
# the extension must be this build's or newer than every file it is built from: a second run
# in the same tree finds it up to date (setuptools skips the link) and must not report it stale
# ... and it loads (a library it links that is missing here is an import error)
built=$(timeout 120 $PY -c 'import glob, importlib, importlib.util as u, os, sys
s = u.find_spec("distllm._cuda")
srcs = glob.glob("csrc/**/*", recursive=True) + ["setup.py"]
newest = max([float(sys.argv[1])] if not srcs else [os.path.getmtime(f) for f in srcs])
fresh = s is not None and os.path.getmtime(s.origin) >= min(newest, float(sys.argv[1]))
if fresh:
    importlib.import_module("distllm._cuda")
print(int(fresh))' "$start" 2>>"$logs/build.log" | tail -1)
say "build rc=$(rcs $rc), distllm._cuda up to date and loading: $([ "${built:-0}" = 1 ] && echo yes || echo no)"
if [ "$rc" -ne 0 ] || [ "${built:-0}" != 1 ]; then failed=1; fi
timeout 120 $PY -m distllm info --json > "$out/info.json" 2>> "$logs/build.log" || true
snap

# the GPU tests (b): the files of one or few tests first, then those that many parametrized
# Triton compiles fill
ordered=(
  tests/gpu/test_bias_gelu_cuda.py
  tests/parallel/test_pipeline_gpu.py
  tests/gpu/test_data_parallel_nccl.py
  tests/gpu/test_train_cuda.py
  tests/gpu/test_overlap_cuda.py
  tests/parallel/tensor/test_overlap.py
  tests/gpu/test_fused_mlp_cuda.py
  tests/gpu/test_linear_gelu_cuda.py
  tests/ops/test_linear_gelu.py
)
existing=()  # a file moved or removed since this list was written must not stop the step
for f in "${ordered[@]}"; do [ -f "$f" ] && existing+=("$f"); done
ordered=("${existing[@]}")
if [ $gpu -eq 0 ]; then
  if [ "$failed" -ne 0 ]; then
    say "no CUDA GPU visible, and the build failed (see build.log in logs.tgz)"
    echo "no CUDA GPU visible and the CUDA extension build failed: see $out/summary.log"
    exit 1
  fi
  # a rehearsal: the tests' command line and their collection, and the benchmark's entry
  timeout 300 $PY -m pytest -m gpu -p no:randomly -p no:cacheprovider --collect-only -q \
    --continue-on-collection-errors "${ordered[@]}" > "$logs/gpu_tests_collected.log" 2>&1
  say "rehearsal: the GPU tests collect with rc=$(rcs $?): $(tail -1 "$logs/gpu_tests_collected.log")"
  timeout 120 $PY -m distllm.bench.gpu_bench --help > "$logs/bench_help.log" 2>&1
  say "rehearsal: python -m distllm.bench.gpu_bench --help rc=$(rcs $?)"
  say "no CUDA GPU visible: stopping before the GPU tests"
  echo "no CUDA GPU visible: built the CUDA extension, stopping before the GPU tests"
  exit 3
fi
echo "gpu_check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); logs in $out"

# (b) GPU tests ------------------------------------------------------------------------------
# any other file with `gpu` tests runs after these
others=$(timeout 120 $PY -m pytest --collect-only -q -m gpu -p no:cacheprovider tests 2>/dev/null \
  | sed -n 's/::.*//p' | sort -u | grep -vxF -f <(printf '%s\n' "${ordered[@]}") || true)
t=$(budget 220 150)  # the benchmark keeps 2.5 minutes: it tunes Triton fully (~20 compiles)
say "gpu tests: ${#ordered[@]} files + $(echo "$others" | grep -c . ) more (timeout ${t}s, 120s per test)"
# -v names each test as it starts (a hang in native code is then named); --durations=0
# times every test, for the next check's budget
timeout -s INT -k 20 "$t" $PY -m pytest -m gpu -p no:randomly -p no:cacheprovider -v -rfEs \
  --durations=0 --continue-on-collection-errors --timeout 120 \
  --junitxml="$out/gpu_tests.xml" "${ordered[@]}" $others > "$logs/gpu_tests.log" 2>&1
rc=$?
last=$(grep -E "^=+ .*(passed|failed|error|skipped).* =+$" "$logs/gpu_tests.log" | tail -1)
say "gpu tests rc=$(rcs $rc): ${last:-$(tail -1 "$logs/gpu_tests.log")}"
grep -E "^(FAILED|ERROR|SKIPPED)" "$logs/gpu_tests.log" | head -20 | while read -r line; do say "  $line"; done
[ "$rc" -ne 0 ] && failed=1
if echo "$last" | grep -q skipped; then say "  a GPU test was skipped: it is no result"; failed=1; fi
snap

# (c) benchmark -------------------------------------------------------------------------------
t=$(budget 180 25)  # the reserve covers the 20 s between SIGINT and SIGKILL
# (on its own line: the tests' budget above keeps it 150 s, of which 25 s go to that grace)
say "benchmark: python -m distllm.bench.gpu_bench (timeout ${t}s)"
# the benchmark tunes Triton fully (the tests cut it to one configuration)
DISTLLM_TRITON_TUNE=full timeout -s INT -k 20 "$t" $PY -m distllm.bench.gpu_bench \
  --out "$out/results.json" > "$logs/bench.log" 2>&1
rc=$?
say "benchmark rc=$(rcs $rc), results.json: $($PY -c 'import json, sys
d = json.load(open(sys.argv[1]))
print(len(d["rows"]), "rows,", "complete" if d.get("complete") else
      "incomplete, not measured: " + ", ".join(d.get("left") or ["?"]))' "$out/results.json" 2>&1 \
  | tail -1)"
[ "$rc" -ne 0 ] && failed=1

say "done in $(( $(date +%s) - start ))s: $([ $failed -eq 0 ] && echo 'all steps passed' || echo 'some step failed')"
cat "$out/summary.log"
exit $failed
