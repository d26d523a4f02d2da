"""The pipeline benchmark on its sleep stages (4 gloo ranks, tiny): every schedule's row,
exact activation peaks, the targets checked per row."""

from __future__ import annotations

import pytest
from distllm.bench import pipeline
from distllm.bench.harness import BenchConfig, run


def test_pipeline_benchmark_smoke():
    """The benchmark's sleep stages on 4 ranks, tiny: rows, exact activation peaks, targets."""
    rows = run(pipeline, BenchConfig(quick=True, reps=1, extra={"ms": [4], "t_ms": 2.0,
                                                       "kinds": ["sleep"]}))
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    assert by["gpipe"]["extra"]["peak_act"] == [4.0] * 4
    assert by["1f1b"]["extra"]["peak_act"] == [4.0, 3.0, 2.0, 1.0]
    assert max(by["zb-h1"]["extra"]["peak_act"]) <= 4.0
    for r in rows:
        e = r["extra"]
        assert len(e["bubble"]) == 4 and all(0.0 <= b < 1.0 for b in e["bubble"])
        assert e["sim_ms"] > 0 and "sim_within_10pct" in e["targets"]


def _synthetic_rows(m: int, interleaved_ratio: float) -> list[dict]:
    """Rows of one sleep case at p=4 as :func:`pipeline._case_rows` leaves them for the
    targets: 1f1b at its ideal bubble, interleaved-1f1b (v=2) at ``interleaved_ratio`` of it."""
    ideal = 3 / (m + 3)

    def r(variant, v, ratio):
        return {"variant": variant, "extra": {
            "sim_err": 0.01, "bubble_mean": ideal * ratio, "bubble_ideal_1f1b": ideal,
            "bubble": [ideal * ratio] * 4, "bubble_vs_1f1b": ratio, "virtual_stages": v,
            "peak_act": [4.0, 3.0, 2.0, 1.0]}}

    return [r("1f1b", 1, 1.0), r("interleaved-1f1b", 2, interleaved_ratio)]


def test_interleaved_target_only_where_a_perfect_schedule_meets_it():
    """At p=4, v=2, m=4 even a perfect interleaved schedule's bubble is 0.636x 1f1b's, so
    the 0.6x target was missed at every --quick run; it is checked from m=8 (0.579x) on."""
    key = "bubble_le_0.6x_1f1b"

    def verdict(m, ratio):
        rows = _synthetic_rows(m, ratio)
        pipeline._targets("sleep", m, rows)
        return rows[1]["extra"]["targets"][key]

    # m=4: the perfect schedule's own ratio is not a miss; the verdict says why
    at4 = verdict(4, 0.64)
    assert at4.startswith("not checked: ") and "0.636x at p=4 v=2 m=4" in at4, at4
    # m=8 and m=16: checked, with the same 0.6 as before
    assert verdict(8, 0.58) == "met" and verdict(16, 0.55) == "met"
    assert verdict(8, 0.65) == "missed: 0.65x"
    # the other targets are untouched by it
    rows = _synthetic_rows(4, 0.64)
    pipeline._targets("sleep", 4, rows)
    assert rows[0]["extra"]["targets"] == {"sim_within_10pct": "met", "peak_le_p": "met"}
    assert pipeline.ideal_interleaved_ratio(4, 4, 2) == pytest.approx(0.636, abs=1e-3)
    assert pipeline.ideal_interleaved_ratio(4, 8, 2) == pytest.approx(0.579, abs=1e-3)
    assert pipeline.ideal_interleaved_ratio(4, 16, 2) == pytest.approx(0.543, abs=1e-3)
