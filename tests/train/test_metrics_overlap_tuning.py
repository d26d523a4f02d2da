"""`metrics.jsonl` marks the steps that `overlap="auto"`'s trial in the step took part in: on
CPU at tp2 the first steps alternate schedules, and once every layer has decided, no later
step is marked."""

from __future__ import annotations

import json
import subprocess
import sys


def test_metrics_mark_the_steps_of_the_overlap_trial(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "distllm", "train", "--nproc", "2", "--tp", "2", "--model",
         "tiny", "--steps", "10", "--global-batch", "4", "--seq-len", "32", "--no-save",
         "--no-progress", "--eval-batches", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flags = [s["overlap_tuning"] for s in steps]
    # the tiny model's 4 blocks call each shape 4 times a step: the 24 calls of a trial (8
    # rounds of sequential and two chunked schedules) take 6 steps
    assert flags[0] and not flags[-1], flags
    settled = flags.index(False)
    assert not any(flags[settled:]), f"a step after the trial ended is marked: {flags}"


def test_metrics_mark_the_steps_of_the_gradient_reduction_trial(tmp_path):
    """At dp2 (DDP) on CPU ``--overlap-grad-reduce auto`` (the default) tries both
    reductions in its first steps: exactly those are marked, and the run learns as usual."""
    from distllm.parallel.data.reduction_trial import trial_cycles

    n = trial_cycles()
    out = subprocess.run(
        [sys.executable, "-m", "distllm", "train", "--nproc", "2", "--dp", "2", "--model",
         "tiny", "--steps", str(n + 3), "--global-batch", "4", "--seq-len", "32", "--no-save",
         "--no-progress", "--eval-batches", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["overlap_tuning"] for s in steps] == [True] * n + [False] * 3, steps
    # the decision is printed once, with its figures
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("gradient reduction ")]
    assert len(said) == 1 and " of the overlapped ones' time, median of 6 rounds" in said[0], \
        out.stderr[-2000:]
    assert all(s["loss"] == s["loss"] for s in steps), steps  # no NaN
