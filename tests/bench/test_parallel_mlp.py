"""The parallel-MLP benchmark runs end to end at a tiny shape (tp2 on 2 gloo ranks and tp1),
with a timed row per variant, the kernel each distllm variant ran, and speed-ups against the
unfused variant computed from the medians."""

from __future__ import annotations

import pytest
import torch
from distllm.bench import parallel_mlp
from distllm.bench.harness import BenchConfig, run


def test_parallel_mlp_bench_rows():
    rows = run(parallel_mlp, BenchConfig(quick=True, shapes="32,16,64", reps=1))
    by = {(r["case"], r["variant"]): r for r in rows}
    cases = {r["case"] for r in rows}
    assert cases == {f"tp{tp} {ph} 32x16x64 float32" for tp in (1, 2) for ph in ("fwd", "fwd+bwd")}
    for case in cases:
        got = {v for c, v in by if c == case}
        assert got == {"fused", "unfused", "auto", "peer"}, (case, got)
        for v in got:
            assert by[case, v]["status"] == "ok" and by[case, v]["ms"] > 0, by[case, v]
        assert by[case, "fused"]["extra"]["kernel"].startswith("cpu: fused"), by[case, "fused"]
        assert by[case, "unfused"]["extra"]["kernel"].startswith("reference: unfused")
        un, fu = by[case, "unfused"]["ms"], by[case, "fused"]["ms"]
        assert by[case, "fused"]["speedup_vs_unfused"] == pytest.approx(un / fu, rel=1e-6)


def test_parallel_mlp_bench_says_why_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on any machine
    [r] = run(parallel_mlp, BenchConfig(device="cuda"))
    assert (r["suite"], r["status"]) == ("parallel_mlp", "unavailable")
    assert "no CUDA device" in r["reason"], r


@pytest.mark.parametrize("m", [7, 2])
def test_every_token_of_the_shape_runs_and_counts(m):
    """x was (4, M // 4, H): 7 tokens ran 4 and 2 ran none, while the FLOP/s counted M."""
    from distllm.bench.harness import Case, run_case

    case = Case(f"tp1 fwd+bwd {m}x16x64 float32", {"tp": 1, "phase": "fwd+bwd",
                                                   "shape": (m, 16, 64)})
    rows = run_case(parallel_mlp, BenchConfig(reps=1), case)
    assert sorted(r["variant"] for r in rows) == ["auto", "fused", "peer", "unfused"]
    for r in rows:
        assert r["status"] == "ok" and r["extra"]["tokens"] == m, r
        flops = 2 * 2 * m * 16 * 64 * 3  # forward and backward of both GEMMs
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-12)
