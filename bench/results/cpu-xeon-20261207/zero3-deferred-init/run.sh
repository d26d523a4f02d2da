#!/usr/bin/env bash
# Memory of building a ZeRO-3 engine at two revisions interleaved: one that builds each rank's
# stage whole before ZeRO-3 shards it, and this one, which materialises and shards one layer at
# a time. First the bytes alive at once, counted on fake tensors (build_bytes.py: no allocator,
# the CUDA code paths; deterministic), then the peak RSS of real CPU ranks (build_peak.py:
# gpt2-medium built, then one step; glibc's allocator included).
# Usage (from the repository root): bash bench/results/cpu-xeon-20261207/zero3-deferred-init/run.sh
#   OTHER_SRC   (OTHER_SRC: a copy of the other revision's tree, its extensions built;
#   THIS_SRC, if set, a copy of this one: the tree can change while it runs)
# Prints "<revision> <dtype> dp<N> round <r>" and a line per rank.
set -euo pipefail
other=$1
here=$(pwd)
py=$here/.venv/bin/python
script=$here/bench/results/cpu-xeon-20261207/zero3-deferred-init/build_peak.py
for round in 1 2; do
  for case in "gpt2-medium float32 4" "gpt2-xl bfloat16 8" "gpt2-xl bfloat16 64"; do
    for v in this other; do
      src=${THIS_SRC:-$here}; [ "$v" = other ] && src=$other
      echo "$v: $(cd /tmp && PYTHONPATH=$src "$py" "${script%/*}/build_bytes.py" $case)"
    done
  done
done
for round in 1 2; do
  for case in "float32 2" "float32 4" "bfloat16 4"; do
    set -- $case
    for v in this other; do
      src=${THIS_SRC:-$here}; [ "$v" = other ] && src=$other
      echo "$v $1 dp$2 round $round"
      (cd /tmp && PYTHONPATH=$src "$py" "$script" gpt2-medium "$1" "$2")
    done
  done
done
