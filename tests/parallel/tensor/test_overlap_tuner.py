"""``overlap="auto"`` on 2 gloo ranks: one measurement per shape, the same choice on every
rank, and, with the measurement's outcome forced each way, the fastest chunk count or the
fallback to no overlap said once in the log. One spawn, each scenario its own test."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from distllm.parallel.tensor import overlap_tuner
from tests._spawn import SpawnCache, case_of, run_cases

DT = torch.float64


def _forced(times: dict[str, float]):
    """A stand-in for the tuner's measurement returning fixed best-of times (ms)."""
    return lambda run, comm, rows, device, reps, extra: (list(times), list(times.values()))


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.lines.append(rec.getMessage())


def _real(dims, x) -> dict:
    """Three calls of one shape with the real measurement."""
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    real, measured = overlap_tuner._measure, []

    def counting(*args):
        measured.append(args[2])
        return real(*args)

    overlap_tuner._measure = counting
    try:
        rw = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
        for _ in range(3):
            rw(x)
    finally:
        overlap_tuner._measure = real
    st = rw.overlap_stats.forward
    choice = torch.tensor([float(st.chunks)])  # MAX over ranks: equal to ours if all agree
    torch.distributed.all_reduce(choice, op=torch.distributed.ReduceOp.MAX)
    return {"measured": len(measured), "calls": st.calls, "comm_ms_est": st.comm_ms_est,
            "reason": st.reason, "chunks": st.chunks, "max_chunks": choice.item()}


def _forced_outcome(dims, x, times: dict[str, float]) -> tuple[str, int, int]:
    """``(mode, chunks, fallback log lines)`` of three calls with the outcome ``times``."""
    from distllm.nn import RowParallelLinear

    overlap_tuner.clear_cache()
    log = _Log()
    logging.getLogger("distllm").addHandler(log)
    real = overlap_tuner._measure
    overlap_tuner._measure = _forced(times)
    try:
        layer = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
        for _ in range(3):
            layer(x)
    finally:
        overlap_tuner._measure = real
        logging.getLogger("distllm").removeHandler(log)
    f = layer.overlap_stats.forward
    return f.mode, f.chunks, len([m for m in log.lines if "falls back" in m])


def tuner_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, dtype=DT)
    return run_cases({
        "real": lambda: _real(dims, x),
        "slower": lambda: _forced_outcome(
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 11.0, "4": 12.0}),
        "faster": lambda: _forced_outcome(
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0}),
        "marginal": lambda: _forced_outcome(  # 2% faster: within the 3% margin
            dims, x, {"compute": 1.0, "sequential": 10.0, "2": 9.8, "4": 9.9}),
    })


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


def test_one_measurement_per_shape_and_the_same_choice_everywhere(spawned):
    for got in case_of(spawned(tuner_main, 2), "real"):
        assert got["measured"] == 1, f"three calls of one shape measured {got['measured']} times"
        assert got["calls"] == 3 and got["comm_ms_est"] >= 0.0 and got["reason"]
        assert got["max_chunks"] == got["chunks"]  # timings are reduced with MAX


@pytest.mark.parametrize("case, want", [
    ("slower", ("none", 0, 1)),  # chunked slower than sequential: no overlap, said once
    ("faster", ("chunked", 2, 0)),  # the fastest chunk count, nothing logged
    ("marginal", ("none", 0, 1)),
])
def test_forced_outcomes(spawned, case, want):
    for got in case_of(spawned(tuner_main, 2), case):
        assert tuple(got) == want


def test_one_rank_never_measures(monkeypatch):
    overlap_tuner.clear_cache()
    monkeypatch.setattr(overlap_tuner, "_measure", lambda *a: pytest.fail("measured"))
    comm = types.SimpleNamespace(backend="gloo", ranks=(0,), world=1)
    ch = overlap_tuner.choose(("k",), lambda c, n: None, comm, 8, torch.device("cpu"), "x")
    assert (ch.chunks, ch.comm_ms) == (0, 0.0) and "tp=1" in ch.reason
    assert overlap_tuner.choose(("k",), None, comm, 8, torch.device("cpu"), "x") is ch  # cached
    overlap_tuner.clear_cache()
    assert overlap_tuner.choose(("k",), None, comm, 8, torch.device("cpu"), "x") is not ch
