"""The one runner: shapes and networks from the config, variants timed in this process or
on gloo ranks (the slowest rank's time), cases that cannot run, and cleanup on failure."""

from __future__ import annotations

import os
import types

import pytest
from distllm.bench import harness
from distllm.bench.harness import BenchConfig, Case, Setup

from tests.bench import fake_ranks, fake_suites


def test_shapes_and_networks():
    presets = [(1, 2, 3)]
    assert harness.shapes(BenchConfig(), presets) == [(1, 2, 3)]
    assert harness.shapes(BenchConfig(shapes="7,769,1000; 4,5,6;"), presets) == [
        (7, 769, 1000), (4, 5, 6)]
    assert harness.networks(BenchConfig()) == [None]
    assert harness.networks(BenchConfig(net="2gbit")) == [None, "2gbit"]
    assert harness.networks(BenchConfig(net="2gbit", quick=True)) == ["2gbit"]


def test_in_process_cases_time_every_variant():
    rows = harness.run(fake_suites, BenchConfig(reps=3))
    assert [r["case"] for r in rows] == ["1,2,3"] * 4 + ["4,5,6"] * 4
    by = {(r["case"], r["variant"]): r for r in rows}
    for case in ("1,2,3", "4,5,6"):
        fused, unfused = by[(case, "fused")], by[(case, "unfused")]
        assert fused["reps"] == unfused["reps"] == 3
        assert fused["ms"] >= 2.0 and unfused["ms"] >= 20.0 and fused["ms"] < unfused["ms"]
        assert by[(case, "fused_cuda")]["status"] == "unavailable"


def test_a_case_that_cannot_run_is_one_unavailable_row():
    mod = types.SimpleNamespace(SUITE="s", __name__="nowhere")  # setup/rows never called
    [r] = harness.run_case(mod, BenchConfig(), Case("c", suite="t", skip="needs CUDA"))
    assert (r["suite"], r["case"], r["status"], r["reason"]) == ("t", "c", "unavailable",
                                                                 "needs CUDA")


def test_multi_rank_case_takes_the_slowest_rank():
    """2 gloo ranks over the emulated link when it can be built (root), else loopback with
    the reason; every repetition is rank 1's 40 ms, never rank 0's 1 ms."""
    [r] = harness.run(fake_ranks, BenchConfig(net="1gbit", quick=True))
    assert r["status"] == "ok" and r["reps"] == 3
    assert r["extra"]["ms_min"] >= fake_ranks.SLOW_MS, r
    info = r["extra"]["info"]
    assert [i["rank"] for i in info] == [0, 1] and all(i["world"] == 2 for i in info)
    assert all(i["calls"] == 4 and i["net"] == "1gbit" for i in info)  # warm-up + 3 reps
    if os.geteuid() == 0:
        assert r["case"] == "two ranks 1gbit" and r["reason"] == "", r
    else:
        assert r["case"] == "two ranks loopback" and "1gbit unavailable" in r["reason"], r


def test_close_runs_when_a_variant_raises():
    closed = []

    def boom() -> None:
        raise RuntimeError("variant failed")

    s = Setup({"boom": boom}, warmup=0, reps=1, close=lambda: closed.append(True))
    with pytest.raises(RuntimeError, match="variant failed"):
        harness.measure(s, distributed=False)
    assert closed == [True]
