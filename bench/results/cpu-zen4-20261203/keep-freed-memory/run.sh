#!/bin/bash
# distllm train at dp2, with glibc keeping freed memory (the default) and without it
# (--no-keep-freed-memory), runs alternating; from the repository root: bash run.sh ZERO OUTDIR
set -euo pipefail
zero=$1; dir=$2
for r in 1 2 3; do
  for v in keep nokeep; do
    flag=""; [ "$v" = nokeep ] && flag="--no-keep-freed-memory"
    .venv/bin/distllm train --nproc 2 --dp 2 --zero "$zero" --model gpt2-small --n-layers 6 \
      --seq-len 64 --global-batch 8 --steps 14 --eval-batches 0 --no-save \
      --out "$dir/e2e-$zero-$v-$r" $flag
    cp "$dir/e2e-$zero-$v-$r/metrics.jsonl" "$dir/e2e-$zero-$v-$r.metrics.jsonl"
  done
done
