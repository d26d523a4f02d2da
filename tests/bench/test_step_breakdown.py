"""The per-step breakdown counts what a step dispatched: top-level operators (a nested one
is not counted twice), copies, new tensors, host reads and time outside operators."""

from __future__ import annotations

import torch
from distllm.bench.step_breakdown import breakdown, compare_breakdowns


def test_counts_of_a_known_step():
    a = torch.randn(64, 64)

    def step():
        b = a @ a  # one operator, one new tensor
        c = b.clone()  # a copy (clone -> copy_), a new tensor
        c.add_(b)  # in place: no copy (a Python scalar would be copied into a tensor)
        return float(c.sum())  # a host read

    bd = breakdown(step)
    assert bd["ops"] == 5  # matmul, clone, add_, sum, item: clone's copy_ is inside clone
    assert bd["copies"] == 1
    assert bd["syncs"] == 1
    assert bd["allocs"] == 3  # mm's result, the clone's, the sum's
    assert bd["collectives"] == 0 and bd["collective_mb"] == 0.0
    assert 0.0 <= bd["outside_ms"] <= bd["wall_ms"]
    assert bd["op_ms"] <= bd["wall_ms"] + 1e-6
    assert bd["top"][0][0].startswith("aten::")


def test_no_sync_when_nothing_is_read():
    two = torch.full((8,), 2.0)
    bd = breakdown(lambda: torch.ones(8).mul_(two))
    assert bd["syncs"] == 0 and bd["copies"] == 0


def test_compare():
    a = {"ops": 10, "syncs": 1, "wall_ms": 2.0}
    b = {"ops": 12, "syncs": 5, "wall_ms": 1.5}
    assert compare_breakdowns(a, b) == {"ops": [10, 12, -2], "syncs": [1, 5, -4],
                                        "wall_ms": [2.0, 1.5, 0.5]}


def test_drain_runs_after_the_step_outside_its_wall_time():
    import time

    calls = []
    bd = breakdown(lambda: calls.append("step"),
                   drain=lambda: (time.sleep(0.05), calls.append("drain")))
    assert calls == ["step", "drain"]
    assert bd["wall_ms"] < 50.0
