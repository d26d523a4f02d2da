"""`distllm train --plan auto` takes the planner's layout, says why, and trains with it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_plan_auto_trains_the_chosen_layout(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "distllm", "train", "--plan", "auto", "--nproc", "2",
         "--model", "tiny", "--steps", "2", "--global-batch", "8", "--seq-len", "32",
         "--no-save", "--no-progress", "--eval-batches", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    chose = [ln for ln in out.stdout.splitlines() if ln.startswith("--plan auto chose")]
    assert len(chose) == 1, out.stdout  # printed once, by the launcher
    name = chose[0].split()[3]  # e.g. tp1.pp1.dp2.zero2.m1
    tp, pp, dp, zero = (int(part[len(key):]) for part, key in
                        zip(name.split(".")[:4], ("tp", "pp", "dp", "zero"), strict=True))
    assert tp * pp * dp == 2
    # the run really used that layout
    assert f"tp{tp}.pp{pp}.dp{dp}.zero{zero}" in out.stdout
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
