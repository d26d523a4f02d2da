"""The end-to-end training suite's cases and its rows from synthetic timings: tokens/s and
distllm against the best torch peer per layout, and the per-step overhead's share."""

from __future__ import annotations

import pytest
from distllm.bench import train_e2e
from distllm.bench.harness import BenchConfig, Result

from distllm.diagnostics.timing import stats_of


def _st(ms: float):
    return stats_of([ms * 0.9, ms, ms * 1.1])


def test_cases_run_every_layout_then_the_overhead():
    got = [(c.label, c.ranks, c.networks, c.suite) for c in train_e2e.cases(BenchConfig())]
    assert got == [("tp2", 2, True, None), ("dp2.zero2", 2, True, None),
                   ("pp2.1f1b", 2, True, None),
                   ("tiny tp1.pp1.dp1", 1, False, "train_overhead")]
    [gpu] = train_e2e.cases(BenchConfig(device="cuda"))
    assert gpu.skip == "the CPU suite (gloo ranks)"


def test_layout_rows_against_the_best_peer():
    case = train_e2e.cases(BenchConfig())[1]
    res = Result({"distllm": _st(50.0), "torch_ddp": _st(40.0),
                  "torch_fsdp2_zero2": _st(80.0)}, {"x": "ImportError: no"},
                 [{"tokens": 1000}, {"tokens": 1000}], "2gbit", "")
    rows = {r["variant"]: r for r in train_e2e.rows(BenchConfig(), case, res)}
    assert rows["distllm"]["extra"]["vs_torch"] == pytest.approx(40.0 / 50.0)
    assert rows["distllm"]["extra"]["tokens_per_s"] == pytest.approx(1000 / 0.05)
    assert rows["torch_ddp"]["extra"]["role"] == "peer"
    assert rows["x"]["status"] == "unavailable" and rows["x"]["reason"] == "ImportError: no"
    assert rows["distllm"]["case"].startswith("2gbit dp2.zero2 ")


def test_overhead_row():
    case = train_e2e.cases(BenchConfig())[-1]
    res = Result({"wall": _st(100.0), "profiled": _st(130.0)}, {}, [{"op_ms": 96.0}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    assert (r["suite"], r["case"], r["ms"]) == ("train_overhead", "tiny tp1.pp1.dp1", 100.0)
    assert r["extra"]["overhead_frac"] == pytest.approx(0.04) and r["extra"]["met"] is True
