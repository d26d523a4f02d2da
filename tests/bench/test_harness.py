"""The one runner: shapes and networks from the config, variants timed in this process or
on gloo ranks (the slowest rank's time), cases that cannot run, and cleanup on failure."""

from __future__ import annotations

import os
import re
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


def test_shapes_below_one_are_refused():
    for spec, says in [("7,0,3", "'7,0,3' has a dimension of 0"),
                       ("1,2,3;4,-5,6", "'4,-5,6' has a dimension of -5"),
                       ("6,768,8,0", "'6,768,8,0' has a dimension of 0"),
                       ("1,x,3", "'1,x,3' is not a list of integers"), (";", "no shape given")]:
        with pytest.raises(ValueError, match=f"^--shapes.*{re.escape(says)}"):
            harness.parse_shapes(spec)
    with pytest.raises(ValueError, match="has a dimension of 0"):  # a suite's own cases()
        harness.shapes(BenchConfig(shapes="0,16,24"), [(1, 2, 3)])
    assert harness.parse_shapes(" 7,769,1000; 2,256,4,32,2 ;") == [(7, 769, 1000),
                                                                   (2, 256, 4, 32, 2)]


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


class _Pipelined:
    """A step that leaves 5 ms of work in flight, which the next step waits for first (as a
    ZeRO-2 forward waits for the previous step's parameter all-gathers)."""

    def __init__(self):
        self.pending, self.calls, self.drains = 0.0, 0, 0

    def step(self):
        import time

        time.sleep(self.pending + 0.002)  # the previous step's work, then this step's own
        self.pending, self.calls = 0.005, self.calls + 1

    def drain(self):
        import time

        time.sleep(self.pending)
        self.pending, self.drains = 0.0, self.drains + 1


def test_loop_step_times_the_middle_step_of_three():
    """A LoopStep call runs three steps and drains; the timer reads the middle step, which
    starts with the first step's work in flight (7 ms here): neither the 2 ms of a step
    alone nor the 21 ms of the whole call; the next call starts with nothing in flight."""
    p = _Pipelined()
    loop = harness.LoopStep(p.step, p.drain)
    stats, _ = harness.measure(Setup({"zero": loop}, warmup=1, reps=3), distributed=False)
    assert (p.calls, p.drains, p.pending) == (12, 4, 0.0)
    assert 7.0 <= stats["zero"].median_ms < 16.0, stats["zero"]
    plain = harness.loop_aware(lambda fn: 99.0)
    assert plain(lambda: None) == 99.0 and plain(loop) == pytest.approx(loop.ms)
    # a step that queues device work: the sync closes the timed region (here 3 ms late)
    import time

    synced = harness.LoopStep(p.step, p.drain, sync=lambda: time.sleep(0.003))
    synced()
    assert 10.0 <= synced.ms < 19.0, synced.ms


def test_an_unavailable_link_after_loopback_is_one_unavailable_row(monkeypatch):
    """``--net`` whose link cannot be built falls back to loopback: in a full run loopback is
    measured already, so the fallback is not run again (its rows would repeat the loopback
    rows' keys); one unavailable row names the rate and the reason. A quick run, which has
    no loopback run of its own, runs the fallback with the reason."""
    import contextlib

    import distllm.testing as testing
    from distllm.diagnostics.timing import stats_of
    from distllm.testing import netem

    @contextlib.contextmanager
    def no_link(rate, nranks=2):
        yield netem.Network("loopback", f"{rate} unavailable: no root" if rate else "", None,
                            None)

    runs = []

    def fake_run_distributed(fn, n, modname, cfg, case, **kw):
        runs.append(case.net)
        return [{"stats": {"slow_on_rank1": stats_of([1.0, 1.1, 1.2])}, "unavailable": {},
                 "info": {"rank": r}} for r in range(n)]

    monkeypatch.setattr(netem, "open_network", no_link)
    monkeypatch.setattr(testing, "run_distributed", fake_run_distributed)
    [case] = fake_ranks.cases(BenchConfig())
    rows = harness.run_case(fake_ranks, BenchConfig(net="2gbit"), case)
    assert runs == [None]  # loopback only: the fallback is not run a second time
    assert [(r["suite"], r["case"], r["variant"], r["status"], r["reason"]) for r in rows] == [
        ("fake_ranks", "two ranks loopback", "slow_on_rank1", "ok", ""),
        ("fake_ranks", "two ranks 2gbit", "-", "unavailable", "2gbit unavailable: no root")]
    runs.clear()
    [r] = harness.run_case(fake_ranks, BenchConfig(net="2gbit", quick=True), case)
    assert runs == ["2gbit"]
    assert (r["case"], r["status"], r["reason"]) == (
        "two ranks loopback", "ok", "2gbit unavailable: no root")
