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
    cfg = BenchConfig(quick=True, out=tmp_path, extra={"layouts": [], "steps": 3})
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
