"""The sequence-parallel overlap benchmark runs end to end (tiny shapes, loopback) with every
row, through the row-parallel benchmark's setup and rows; a device it does not run on is one
row with the reason."""

from __future__ import annotations

from distllm.bench import sp_overlap
from distllm.bench.harness import BenchConfig, run

from tests.bench.test_row_parallel_overlap import check_rows


def test_sp_bench_rows():
    cfg = BenchConfig(quick=True, shapes="64,32,64", reps=1)
    check_rows(run(sp_overlap, cfg), ("ag", "rs"))


def test_sp_bench_says_why_off_cpu():
    [r] = run(sp_overlap, BenchConfig(device="cuda"))
    assert (r["suite"], r["status"]) == ("sp_overlap", "unavailable")
    assert "2 gloo ranks on CPU" in r["reason"], r
