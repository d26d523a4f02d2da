"""The overlap doctor on 2 gloo ranks: it must fail loudly when an overlap asked for is not
happening (a RowParallelLinear built with overlap="none"), and report per layer what ran."""

from __future__ import annotations

import pytest
import torch

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
    from distllm.bench.doctor import OverlapNotHappening, diagnose

    import distllm

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
        assert r["profiled_collectives"].get("c10d::allreduce_") == 8, r
    assert "| 1 (RowParallelLinear) | forward | all_reduce | chunked | chunked x4 | 2/2 |" \
        in res["md"]
    assert res["lanes"] == ["comm", "compute"]
    assert all("hidden (asked for at least 101%)" in f for f in res["strict_failures"])
    assert len(res["strict_failures"]) == 2
    ok, failures, notes = res["bare"]
    assert not ok and "no overlap-capable layer" in failures[0] and notes
    assert "steps=0" in res["bad_steps"]


def test_doctor_cli_exit_code(tmp_path, capsys):
    from distllm.cli import main

    rc = main(["bench", "--doctor", "--overlap", "none", "--require-overlap", "--steps", "1",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 1, captured.out
    assert "overlap asked for but not happening" in captured.err
    md = (tmp_path / "DOCTOR.md").read_text()
    assert "**FAIL**" in md and "RowParallelLinear" in md
    assert (tmp_path / "doctor.json").is_file() and (tmp_path / "doctor_trace.json").is_file()
    assert (tmp_path / "doctor_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_timeline_interval_algebra():
    from distllm.bench.timeline import hidden, merge, overlap_ms

    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap_ms([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    tl = [{"lane": "comm", "name": "ar", "start_ms": 1.0, "end_ms": 3.0},
          {"lane": "comm", "name": "ar", "start_ms": 2.0, "end_ms": 4.0},
          {"lane": "compute", "name": "mm", "start_ms": 0.0, "end_ms": 2.5}]
    assert hidden(tl) == (pytest.approx(3.0), pytest.approx(1.5))
