"""The pipeline benchmark on its sleep stages (4 gloo ranks, tiny): every schedule's row,
exact activation peaks, the targets checked per row."""

from __future__ import annotations

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
