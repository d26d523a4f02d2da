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


def _burn(ms: float) -> None:
    """Spend ``ms`` of this thread's own CPU time."""
    import time

    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def test_cpu_split_counts_the_step_thread_and_the_others_apart():
    """A step whose helper thread (alive before and after, as gloo's are) burns 30 ms of CPU
    while the step's own thread burns 15 ms: each is counted on its side."""
    import os
    import threading

    import pytest
    from distllm.bench.step_breakdown import cpu_split

    if not os.path.isdir("/proc/self/task"):  # no per-thread times here: nothing is made up
        assert cpu_split(lambda: None) == {}
        return
    go, done, stop = threading.Event(), threading.Event(), threading.Event()

    def helper():
        while not stop.is_set():
            if go.wait(0.01):
                go.clear()
                _burn(30.0)
                done.set()

    t = threading.Thread(target=helper, daemon=True)
    t.start()
    steps, drained = [0], []  # steps since the last drain; at each drain, that count

    def step():
        steps[0] += 1
        done.clear()
        go.set()
        _burn(15.0)
        done.wait(10)

    try:
        split = cpu_split(step, drain=lambda: (drained.append(steps[0]), steps.__setitem__(0, 0)),
                          reps=3)
    finally:
        stop.set()
        t.join(5)
    assert drained == [2, 2, 2]  # with a drain, one step before each measured one (a loop's)
    # the window holds one step: 15 ms on the step's thread and 30 on the helper, not two
    assert 14.0 <= split["main_cpu_ms"] <= min(split["wall_ms"] + 1.0, 25.0), split
    assert 29.0 <= split["other_threads_cpu_ms"] < 50.0, split
    assert sum(split["threads_cpu_ms"].values()) == pytest.approx(
        split["other_threads_cpu_ms"], abs=1e-2)
    assert split["main_wait_ms"] >= 0.0


def test_compare_includes_the_cpu_split():
    a = {"ops": 1, "cpu": {"main_cpu_ms": 10.0, "other_threads_cpu_ms": 5.0}}
    b = {"ops": 2, "cpu": {"main_cpu_ms": 12.0, "other_threads_cpu_ms": 2.0}}
    assert compare_breakdowns(a, b) == {"ops": [1, 2, -1],
                                        "cpu.main_cpu_ms": [10.0, 12.0, -2.0],
                                        "cpu.other_threads_cpu_ms": [5.0, 2.0, 3.0]}


def test_a_onednn_kernel_is_an_operator():
    """torch's CPU linear and distllm's cpu backend run oneDNN kernels as ``mkldnn::`` ops:
    counted as operators (their time is not "outside"); autograd's nodes are not."""
    from distllm.bench.step_breakdown import _is_op

    assert _is_op("mkldnn::_linear_pointwise") and _is_op("aten::addmm")
    assert _is_op("distllm::linear_gelu_fwd") and _is_op("c10d::allreduce_")
    assert not _is_op("autograd::engine::evaluate_function: AddmmBackward0")
    assert not _is_op("_ParallelMLPBackward") and not _is_op("Optimizer.step#AdamW.step")


def test_what_drain_runs_is_not_counted():
    """``drain`` runs under the profiler after the step: its operators (here 20 matmuls, the
    step's one) were counted as the step's, and their time could exceed the step's wall."""
    a = torch.randn(64, 64)

    def drain():
        for _ in range(20):
            a @ a

    bd = breakdown(lambda: a @ a, drain=drain)
    assert bd["ops"] == 1 and bd["allocs"] == 1, bd
    assert [name for name, _, _ in bd["top"]] == ["aten::matmul"]
    assert bd["top"][0][1] == 1
    assert bd["op_ms"] <= bd["wall_ms"] + 1e-6


def test_each_host_read_counts_once():
    """``tolist()`` dispatches no ``_local_scalar_dense``: it was not counted at all, while
    ``item()`` and ``float()`` were; each read counts once, whichever way it was made."""
    t = torch.arange(4.0)
    s = t.sum()
    assert breakdown(lambda: t.tolist())["syncs"] == 1
    assert breakdown(lambda: s.item())["syncs"] == 1
    assert breakdown(lambda: float(s))["syncs"] == 1
    assert breakdown(lambda: (t.tolist(), s.item()))["syncs"] == 2
    assert breakdown(lambda: (s.tolist(), s.tolist(), float(s)))["syncs"] == 3
    orig = torch.Tensor.tolist
    breakdown(lambda: t.tolist())
    assert torch.Tensor.tolist is orig  # restored after the step


def test_tolist_outside_the_step_is_not_counted():
    t = torch.arange(4.0)
    calls = []
    bd = breakdown(lambda: None, before=lambda: calls.append(t.tolist()),
                   drain=lambda: calls.append(t.tolist()))
    assert bd["syncs"] == 0 and len(calls) == 2
