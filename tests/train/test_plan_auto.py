"""`distllm train --plan auto` takes the planner's layout, says why, and trains with it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


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
    # the run really used that layout: the trainer's banner (rank 0, on stderr) reports the
    # mesh the ranks built, which the launcher's line above does not
    banner = [ln for ln in out.stderr.splitlines() if ln.startswith("distllm train: tiny")]
    assert len(banner) == 1, f"no training banner on stderr:\n{out.stderr[-2000:]}"
    ran = re.search(r" (tp\d+\.pp\d+\.dp\d+\.zero\d) .*micro_batches=(\d+) .*world=(\d+)",
                    banner[0])
    assert ran, banner[0]
    assert ran.group(1) == f"tp{tp}.pp{pp}.dp{dp}.zero{zero}", (
        f"the planner chose {name} but the ranks trained {ran.group(1)}")
    planned_m = re.search(r"\.m(\d+)(?:\.|$)", name).group(1)
    assert ran.group(2) == planned_m, f"micro-batches: planned {name}, ran {ran.group(2)}"
    assert ran.group(3) == "2", banner[0]
    steps = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)


def test_plan_auto_plans_the_model_it_trains():
    """The planner sees --n-layers (a 1-block tiny fills at most 3 pipeline chunks) and
    --dtype (float64 parameters take twice float32's memory)."""
    from distllm.train.cli import apply_plan, precheck
    from distllm.train.config import TrainConfig

    cfg, _ = apply_plan(TrainConfig(model="tiny", n_layers=1), 8)
    assert cfg.parallel.pp * cfg.parallel.chunks_per_rank <= 3, cfg.parallel
    precheck(cfg, 8)

    def params_gb(dtype: str) -> float:
        _, why = apply_plan(TrainConfig(model="tiny", dtype=dtype, global_batch=8,
                                        seq_len=32), 1)  # one layout: tp1.pp1.dp1
        return float(re.search(r"memory: params ([0-9.e-]+) GB", why).group(1))

    assert params_gb("float64") == pytest.approx(2 * params_gb("float32"), rel=0.02)


@pytest.mark.parametrize("flag", [dict(vocab_parallel="off"), dict(batch_split=2)])
def test_plan_auto_keeps_sequence_parallelism_off_where_a_flag_rules_it_out(flag):
    """--vocab-parallel off and --batch-split N run only without sequence parallelism, which
    distllm train has no flag to switch off: the plan chose it anyway, and the run was then
    refused for a flag the user never gave."""
    from distllm.train.cli import apply_plan, precheck
    from distllm.train.config import ParallelConfig, TrainConfig

    def planned(**par):
        cfg = TrainConfig(model="gpt2-small", n_layers=2, global_batch=8, seq_len=128,
                          parallel=ParallelConfig(tp=2, **par))
        return apply_plan(cfg, 2, {"tp": 2})[0]

    assert planned().parallel.sequence_parallel  # (the plan's choice where nothing rules it out)
    cfg = planned(**flag)
    assert not cfg.parallel.sequence_parallel, cfg.parallel
    precheck(cfg, 2)
