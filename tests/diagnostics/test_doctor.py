"""The overlap doctor on 2 gloo ranks: it must fail loudly when an overlap asked for is not
happening (a RowParallelLinear built with overlap="none"), and report per layer what ran."""

from __future__ import annotations

import types

import pytest
import torch

from distllm.diagnostics import diagnose
from distllm.testing import run_distributed


def _mlp(dims, col_overlap: str, row_overlap: str) -> torch.nn.Module:
    from distllm.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    return torch.nn.Sequential(
        ColumnParallelLinear(64, 128, dims, activation="gelu", overlap=col_overlap),
        RowParallelLinear(128, 64, dims, overlap=row_overlap))


def _stepper(model: torch.nn.Module):
    x = torch.randn(96, 64, requires_grad=True)  # (tokens, hidden): dX makes the column layer
    # all-reduce in backward

    def step():
        x.grad = None
        model.zero_grad()
        model(x).square().mean().backward()

    return step


def _rows(rep) -> list[dict]:
    return [{k: getattr(r, k) for k in ("layer", "kind", "direction", "collective", "requested",
                                        "mode", "calls", "overlapped", "hidden_frac", "comm_ms",
                                        "wait_ms", "layer_ms", "ideal_ms", "compute_ms",
                                        "failure", "profiled_collectives", "hidden_source",
                                        "comm_trace_ms")} for r in rep.rows]


def _doctor_checks() -> dict:
    import distllm
    from distllm.diagnostics import OverlapNotHappening

    dims = distllm.ParallelDims(tp=2)
    out: dict = {}
    off = _mlp(dims, "chunked", "none")  # the user asks for overlap; the row layer has it off
    try:
        diagnose(off, _stepper(off), steps=2, require_overlap=True)
        out["raised"] = None
    except OverlapNotHappening as exc:
        out["raised"] = str(exc)
        out["off_rows"] = _rows(exc.report)
    # without require_overlap only layers built with overlap="chunked" are held to it
    out["default_ok"] = diagnose(off, _stepper(off), steps=1).ok
    on = _mlp(dims, "chunked", "chunked")
    rep = diagnose(on, _stepper(on), steps=2, require_overlap=True)
    out["on_rows"], out["on_ok"], out["md"] = _rows(rep), rep.ok, rep.to_markdown()
    out["lanes"] = sorted({e["lane"] for e in rep.timeline})
    strict = diagnose(on, _stepper(on), steps=1, min_hidden=1.01, raise_on_failure=False)
    out["strict_failures"] = strict.failures
    plain = torch.nn.Linear(8, 8)
    bare = diagnose(plain, lambda: plain(torch.ones(2, 8)).sum().backward(), steps=1,
                    require_overlap=True, raise_on_failure=False)
    out["bare"] = (bare.ok, bare.failures, bare.notes)
    from distllm.nn import ParallelMLP

    fused = ParallelMLP(64, 128, dims, overlap="chunked")  # fc1 and fc2 run in one function
    rep = diagnose(fused, _stepper(fused), steps=2, require_overlap=True,
                   raise_on_failure=False)
    out["fused_rows"], out["fused_notes"], out["fused_ok"] = _rows(rep), rep.notes, rep.ok
    try:
        diagnose(on, _stepper(on), steps=0)
        out["bad_steps"] = None
    except ValueError as exc:
        out["bad_steps"] = str(exc)
    return out


@pytest.fixture(scope="module")
def doctor_results():
    return run_distributed(_doctor_checks, 2, timeout=240)


def test_doctor_fails_loudly_on_disabled_overlap(doctor_results):
    for res in doctor_results:  # both ranks reach the same verdict
        assert res["raised"] and "overlap asked for but not happening" in res["raised"]
        row = next(r for r in res["off_rows"] if r["kind"] == "RowParallelLinear")
        assert (row["direction"], row["collective"], row["requested"], row["mode"]) == \
            ("forward", "all_reduce", "none", "none")
        assert row["calls"] == 2 and row["overlapped"] == 0 and row["hidden_frac"] == 0.0
        assert "overlap='none'" in row["failure"] and "1 forward" in res["raised"]
        col = next(r for r in res["off_rows"] if r["kind"] == "ColumnParallelLinear")
        assert col["direction"] == "backward" and col["overlapped"] == col["calls"] == 2
        assert not col["failure"]
        assert res["default_ok"] is True


def test_doctor_reports_overlapped_layers(doctor_results):
    res = doctor_results[0]
    assert res["on_ok"]
    got = {(r["kind"], r["direction"]) for r in res["on_rows"]}
    assert got == {("RowParallelLinear", "forward"), ("ColumnParallelLinear", "backward")}
    for r in res["on_rows"]:
        assert r["requested"] == "chunked" and r["mode"] == "chunked"
        assert r["calls"] == r["overlapped"] == 2 and not r["failure"]
        assert r["comm_ms"] > 0 and r["wait_ms"] >= 0 and r["layer_ms"] > 0
        assert 0.0 <= r["hidden_frac"] <= 1.0 and r["hidden_source"] == "trace"
        assert r["comm_trace_ms"] > 0  # gloo's worker-thread events, seen by the profiler
        assert r["ideal_ms"] == pytest.approx(max(r["compute_ms"], r["comm_ms"]))
        # 4 chunks per call, 2 profiled steps: the profiler saw every chunk's all-reduce
        # (on 2 gloo ranks each all-reduce is the exchange: one send and one receive)
        assert r["profiled_collectives"] == {"gloo:send": 8, "gloo:recv": 8}, r
    assert "| 1 (RowParallelLinear) | forward | all_reduce | chunked | chunked x4 | 2/2 |" \
        in res["md"]
    row = next(line for line in res["md"].splitlines() if line.startswith("| 1 (RowParallel"))
    assert set(row.split(" | ")[6].split(", ")) == {"8x send", "8x recv"}, row
    assert res["lanes"] == ["comm", "compute"]
    assert all("hidden (asked for at least 101%)" in f for f in res["strict_failures"])
    assert len(res["strict_failures"]) == 2
    ok, failures, notes = res["bare"]
    assert not ok and "no overlap-capable layer" in failures[0] and notes
    assert "steps=0" in res["bad_steps"]


class _Counter:
    """One direction of an overlap record, as the tensor-parallel layers keep it."""

    def __init__(self, collective: str | None):
        self.calls = self.overlapped = self.chunks = 0
        self.wait_ms = self.comm_ms_est = 0.0
        self.mode, self.reason = "none", ""
        if collective is not None:
            self.collective = collective


class FakeRowParallelLinear(torch.nn.Module):
    """Named like a row-parallel layer (whose forward collective a guess from the name would
    take for an all-reduce); its record says which collective really ran."""

    def __init__(self, ran: str | None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.overlap, self.ran = "chunked", ran
        self.overlap_stats = types.SimpleNamespace(forward=_Counter(ran),
                                                   backward=_Counter(None))

    def forward(self, x):
        c = self.overlap_stats.forward
        c.calls, c.overlapped, c.mode, c.chunks = c.calls + 1, c.overlapped + 1, "chunked", 2
        return self.lin(x)


@pytest.mark.parametrize("ran, shown", [("reduce_scatter", "reduce_scatter"),
                                        ("all_gather", "all_gather"),
                                        (None, "all_reduce")])  # no field: inferred
def test_doctor_reads_the_collective_that_ran(ran, shown):
    layer = FakeRowParallelLinear(ran)
    rep = diagnose(layer, lambda: layer(torch.ones(2, 4)), steps=2, warmup=0,
                   measure_comm=False)
    [row] = rep.rows
    assert (row.direction, row.collective, row.calls, row.overlapped) == (
        "forward", shown, 2, 2), row
    assert f"| forward | {shown} | chunked | chunked x2 | 2/2 |" in rep.to_markdown()


def test_doctor_times_the_layers_of_a_fused_mlp(doctor_results):
    """ParallelMLP computes fc1 and fc2 in one function (their forwards are never called):
    the doctor times them through the MLP and says so."""
    for res in doctor_results:
        rows = {(r["layer"], r["direction"]): r for r in res["fused_rows"]}
        assert set(rows) == {("fc1", "backward"), ("fc2", "forward")}, rows.keys()
        for r in rows.values():
            assert r["calls"] == 2 and r["overlapped"] == 2, r
            assert r["layer_ms"] is not None and r["layer_ms"] > 0, r
        assert rows["fc1", "backward"]["collective"] == "all_reduce"
        # each row has the function's collectives as the profiler saw them (the innermost
        # range, fc2's, took them all: fc1's backward all-reduces were in no row)
        for r in rows.values():
            assert sum(r["profiled_collectives"].values()) > 0, r
            assert r["comm_trace_ms"] is not None and r["hidden_source"] == "trace", r
        assert any("fc1, fc2: run as one fused function, timed together (each row shows the "
                   "whole function's time, and its collectives and their hidden share)" in n
                   for n in res["fused_notes"])
        assert res["fused_ok"], res["fused_rows"]


def test_the_doctor_waits_for_the_models_own_gpu(monkeypatch):
    # a bare synchronize() waits for the current device (cuda:0 where a rank never set its
    # own): the step times would be launch times
    from distllm.diagnostics import doctor

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    model = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(
        device=torch.device("cuda", 3))]))
    sync, cuda = doctor._device_sync(model)
    sync()
    assert cuda and synced == [torch.device("cuda", 3)]
    sync, cuda = doctor._device_sync(torch.nn.Linear(2, 2))
    assert not cuda and sync() is None and synced == [torch.device("cuda", 3)]


def test_min_hidden_fails_where_the_share_is_not_measured():
    # on CUDA the host never waits for the collective: no hidden share, and a gate asking
    # for one must fail, not pass unchecked
    from distllm.diagnostics.doctor import LayerDirection, _judge

    r = LayerDirection(layer="mlp.fc2", kind="RowParallelLinear", direction="forward",
                       collective="all_reduce", requested="chunked", mode="chunked", calls=2,
                       overlapped=2, chunks=2, reason="", wait_ms=None, comm_ms=0.6,
                       comm_source="auto", layer_ms=None, profiled_collectives={})
    r.finish()
    assert r.hidden_frac is None
    fails = _judge([r], None, 0.9)
    assert fails == ["mlp.fc2 forward: the hidden share of the all_reduce was not measured "
                     "(CUDA: the host does not wait), so min_hidden=0.9 cannot be checked: "
                     "read the trace"]
    assert _judge([r], None, None) == []
    # on CPU: a wait longer than the collective alone (no trace share) measures nothing
    r.wait_ms, r.failure = 3.0, ""
    r.finish()
    assert r.hidden_frac is None
    assert _judge([r], None, 0.5) == [
        "mlp.fc2 forward: the hidden share of the all_reduce was not measured (the host "
        "waited 3 ms per call, longer than the 0.6 ms the collective takes alone), so "
        "min_hidden=0.5 cannot be checked: read the trace"]


def test_overlap_not_happening_pickles_with_its_report():
    """A worker process's exception reaches its parent: it unpickles, report included."""
    import pickle

    from distllm.diagnostics.doctor import DoctorReport, OverlapNotHappening

    rep = DoctorReport(steps=2, step_ms=1.5, rows=[], failures=["x"], notes=[])
    back = pickle.loads(pickle.dumps(OverlapNotHappening("not overlapped", rep)))
    assert str(back) == "not overlapped" and back.report == rep


def test_a_wait_longer_than_the_collective_is_flagged_not_clamped():
    # 2.98 ms waited per call for an all-reduce of 0.65 ms alone: the timer share would be
    # -360%; it is not shown as 0% hidden, and the report says why
    from distllm.diagnostics.doctor import LayerDirection, _notes

    def one(wait_ms):
        r = LayerDirection(layer="l", kind="RowParallelLinear", direction="backward",
                           collective="all_reduce", requested="chunked", mode="chunked",
                           calls=2, overlapped=2, chunks=2, reason="", wait_ms=wait_ms,
                           comm_ms=0.648, comm_source="auto", layer_ms=4.0,
                           profiled_collectives={})
        r.finish()
        return r

    bad, good = one(2.98), one(0.162)
    assert bad.hidden_frac is None and "waited 2.98 ms" in bad.suspect()
    assert good.hidden_frac == pytest.approx(0.75) and good.suspect() == ""
    probe = types.SimpleNamespace(notes=[])
    notes = _notes(probe, ["l"], [bad, good], cuda=False)
    assert len(notes) == 1 and "l backward: waited 2.98 ms" in notes[0]


def test_the_trace_is_written_whole(tmp_path, monkeypatch):
    """``trace_path``: the profiler's Chrome trace, written beside it and renamed over it (a
    crash mid-write left a cut JSON file under the final name)."""
    import json

    layer = FakeRowParallelLinear(None)
    trace = tmp_path / "trace.json"
    trace.write_text("an earlier trace")
    diagnose(layer, lambda: layer(torch.ones(2, 4)), steps=1, warmup=0, measure_comm=False,
             trace_path=str(trace))
    assert any(e.get("name", "").startswith("doctor::") for e in
               json.loads(trace.read_text())["traceEvents"])
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]

    def cut(self, path):  # a write that dies part-way
        open(path, "w").write('{"traceEvents": [')
        raise OSError("no space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", cut)
    with pytest.raises(OSError, match="no space"):
        diagnose(layer, lambda: layer(torch.ones(2, 4)), steps=1, warmup=0,
                 measure_comm=False, trace_path=str(trace))
    assert json.loads(trace.read_text())["traceEvents"]  # the earlier one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
