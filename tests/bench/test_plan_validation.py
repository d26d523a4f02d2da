"""The planner-validation suite: the planner's pick trained on 4 gloo ranks with its
prediction beside the measurement, the layout names it reads back, and an emulated network
that cannot be built reported as such."""

from __future__ import annotations

import json
import math

import pytest
from distllm.bench import plan_validation as pv
from distllm.bench.harness import BenchConfig, run


@pytest.mark.parametrize("t", pv.LAYOUTS)
def test_layout_names_read_back(t):
    assert pv.parse_layout(pv._layout(t).name()) == t


def test_the_planners_pick_is_measured_and_predicted(tmp_path):
    cfg = BenchConfig(quick=True, out=tmp_path, extra={"layouts": [], "steps": 5})
    rows = run(pv, cfg)
    [lay], planner = rows[:1], rows[1:]
    assert lay["status"] == "ok" and lay["case"] == "tiny/loopback", lay
    e = lay["extra"]
    assert e["planner_pick"] is True and lay["ms"] > 0 and e["predicted_ms"] > 0
    assert math.isclose(e["time_error"], e["predicted_ms"] / lay["ms"] - 1, rel_tol=1e-9)
    assert e["measured_mem_mb"] > 0 and e["predicted_mem_mb"] > 0
    assert math.isclose(e["mem_error"], e["predicted_mem_mb"] / e["measured_mem_mb"] - 1,
                        rel_tol=1e-9)
    assert [r["variant"] for r in planner] == [
        f"planner first among measured: {lay['variant']}",
        f"planner search's pick: {lay['variant']}"]
    for r in planner:  # one layout measured: it is the fastest
        assert r["extra"]["slowdown_vs_fastest"] == 0.0
        assert r["reason"] == f"fastest measured: {lay['variant']}"
    assert json.loads((tmp_path / "profile.json").read_text())["name"] == "cpu"


_FAILURE = ("_rank_main: rank 0 of 4 failed:\nTraceback (most recent call last):\n"
            '  File "trainer.py", line 1, in train\nRuntimeError: boom\n'
            "(ranks [1] failed after it; first lines: rank 1: RuntimeError: peer)")


@pytest.mark.parametrize("fails", ["a layout", "the pick"])
def test_a_layout_whose_run_fails_is_a_row_and_the_others_are_kept(monkeypatch, fails):
    """One layout's failed (or timed-out) training run took every layout already measured
    with it: the case was one error."""
    from distllm.testing import DistributedFailure

    cfg = BenchConfig(quick=True, reps=2, extra={"layouts": [pv.LAYOUTS[0], pv.LAYOUTS[3]],
                                                 "steps": 5})
    pick = pv._as_tuple(pv._planner_pick(pv._profile(cfg), pv.RANKS))
    assert pick not in (pv.LAYOUTS[0], pv.LAYOUTS[3])  # measured as a third layout
    bad = pv.LAYOUTS[3] if fails == "a layout" else pick
    runs = []

    def fake(t, steps, net, data, probe):
        runs.append(t)
        if t == bad:
            raise DistributedFailure(_FAILURE)
        ms = {pv.LAYOUTS[0]: 0.1, pv.LAYOUTS[3]: 0.2, pick: 0.3}[t]
        return {"times": [ms] * 3, "mem": {"total": 1e8, "states": 6e7, "step_peak": 4e7},
                "per_rank": [], "tuning_steps": 0}

    monkeypatch.setattr(pv, "_measure", fake)
    rows = run(pv, cfg)
    assert runs.count(bad) == 1 and len(runs) == 5  # failed once: not run again
    why = ("its training run failed: DistributedFailure: _rank_main: rank 0 of 4 failed: "
           "RuntimeError: boom")
    got = {r["variant"]: (r["status"], r["reason"]) for r in rows}
    names = [pv._layout(t).name() for t in (pv.LAYOUTS[0], pv.LAYOUTS[3], pick)]
    assert [r["variant"] for r in rows[:3]] == names
    for t, name in zip((pv.LAYOUTS[0], pv.LAYOUTS[3], pick), names, strict=True):
        assert got[name] == (("unavailable", why) if t == bad else ("ok", ""))
    fastest = f"fastest measured: {names[0]}"
    pick_row = ("unavailable", why) if bad == pick else ("ok", fastest)
    assert [got[v] for v in [r["variant"] for r in rows[3:]]] == [("ok", fastest), pick_row]
    assert rows[4]["variant"] == f"planner search's pick: {names[2]}"


@pytest.mark.parametrize("steps", [0, 2, 4])
def test_too_few_steps_are_refused_before_anything_runs(steps):
    """With no step left after the warm-up a layout's samples were empty, and the rows
    raised StatisticsError after every run had been made."""
    with pytest.raises(ValueError) as exc:
        pv.cases(BenchConfig(quick=True, extra={"steps": steps}))
    assert str(exc.value) == (
        f"plan_validation: cfg.extra['steps'] = {steps}: each training run needs at least 5 "
        "steps (2 of warm-up, then 3 timed); set cfg.extra['steps'] to 5 or more")


def test_the_profile_is_written_whole(tmp_path, monkeypatch):
    """A run killed while writing profile.json keeps the earlier one whole."""
    from distllm.plan import load_profile
    from tests.bench.interrupted import Killed, half_writes

    profile = load_profile("cpu")
    first = pv._write_profile(tmp_path, profile).read_text()
    half_writes(monkeypatch)
    with pytest.raises(Killed):
        pv._write_profile(tmp_path, profile)
    monkeypatch.undo()
    assert (tmp_path / "profile.json").read_text() == first
    assert json.loads(first)["name"] == "cpu"


def test_an_emulated_network_that_cannot_be_built_is_a_row(monkeypatch):
    from distllm.testing import netem

    monkeypatch.setattr(netem, "_unavailable_reason", lambda nranks, delay_ms: "no namespaces")
    [r] = run(pv, BenchConfig(quick=True, net="1gbit", extra={"layouts": []}))
    assert (r["case"], r["variant"], r["status"], r["reason"]) == (
        "tiny/4 ranks", "1gbit", "unavailable", "no namespaces")


def test_step_peak_counts_frees_outside_operators():
    """ZeRO-3 frees gathered parameters by resizing their storage, which the profiler's
    memory events do not see; the allocator's bytes in use do."""
    import torch

    def gather_twice():
        for _ in range(2):
            full = torch.ones(2_000_000)  # 8 MB gathered
            full.untyped_storage().resize_(0)  # freed as ZeRO-3 frees it

    peak, how = pv._peak_during(gather_twice)
    assert "mallinfo2" in how
    assert 7.9e6 < peak < 9e6, peak

    def hold():
        a = torch.ones(5_000_000)  # 20 MB, alive while the next 20 MB are made
        b = torch.ones(5_000_000)
        return a, b

    peak, _ = pv._peak_during(hold)
    assert 39.9e6 < peak < 41e6, peak
