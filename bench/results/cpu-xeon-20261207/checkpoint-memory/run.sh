#!/usr/bin/env bash
# Peak host memory of a ZeRO-3 run (2 CPU ranks, gpt2-small cut to 2 blocks, 2 steps) without a
# save, with its final save, and of its resume to step 3, at two revisions interleaved.
# Usage (from the repository root): bash bench/results/cpu-xeon-20261207/checkpoint-memory/run.sh
#   OTHER_SRC OUT   (OTHER_SRC: a copy of the other revision's tree, its extensions built)
# Prints "<revision>-<case>-<round> <peak RSS KiB of the largest rank> <wall s>".
set -euo pipefail
other=$1 out=$2
py=$(pwd)/.venv/bin/python
mkdir -p "$out"
run() {  # source tag extra...
  local src=$1 tag=$2; shift 2
  (cd "$out" && PYTHONPATH=$src /usr/bin/time -f "%M %e" -o "$tag.rss" "$py" -m distllm train \
     --nproc 2 --dp 2 --zero 3 --model gpt2-small --n-layers 2 --global-batch 4 --seq-len 64 \
     --eval-batches 0 "$@" > "$tag.log" 2>&1)
  echo "$tag $(cat "$out/$tag.rss")"
}
for round in 1 2; do
  for v in this other; do
    src=$(pwd); [ "$v" = other ] && src=$other
    o=$out/run-$v-$round
    run "$src" "$v-nosave-$round" --steps 3 --stop-after 2 --no-save --out "$o-n"
    run "$src" "$v-save-$round" --steps 3 --stop-after 2 --out "$o"
    run "$src" "$v-resume-$round" --steps 3 --resume --no-save --out "$o"
  done
done
