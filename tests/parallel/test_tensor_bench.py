"""The overlap benchmarks run end to end (tiny shapes, loopback) and produce every row."""

from __future__ import annotations

import torch
from distllm.bench import row_parallel_overlap, sp_overlap
from distllm.bench.harness import BenchConfig


def _check(rows, kinds):
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    for kind in kinds:
        got = {r["variant"]: r for r in rows if r["case"].startswith(kind + " ")}
        for v in ("gemm", "sequential", "chunked2", "chunked4", "chunked8", "auto", "ideal",
                  "gemm_chunked4"):
            assert v in got, (kind, sorted(got))
        comm = next(got[n] for n in ("allreduce", "allgather_alone", "reducescatter_alone")
                    if n in got)
        assert got["ideal"]["ms"] == max(got["gemm"]["ms"], comm["ms"])
        assert got["chunked4"]["hidden_frac"] is not None
        assert "chunking_penalty" in got["gemm_chunked4"]["extra"]
        assert got["auto"]["extra"]["auto_chunks"] in (0, 2, 4, 8)
        lanes = {e["lane"] for e in got["sequential"]["extra"]["timeline"]}
        assert lanes == {"compute", "comm"}


def test_row_parallel_bench_rows():
    cfg = BenchConfig(quick=True, shapes="64,32,64", reps=1)
    _check(row_parallel_overlap.run(cfg), ("fwd", "bwd"))


def test_sp_bench_rows():
    cfg = BenchConfig(quick=True, shapes="64,32,64", reps=1)
    _check(sp_overlap.run(cfg), ("ag", "rs"))


def test_cuda_rows_say_why_when_unavailable():
    rows = row_parallel_overlap.run(BenchConfig(device="cuda", dtype="bfloat16", quick=True))
    if not torch.cuda.is_available():
        assert rows[0]["status"] == "unavailable" and "CUDA" in rows[0]["reason"]
    else:
        assert {r["variant"] for r in rows} >= {"gemm", "gemm_chunked4", "gemm_with_copy"}
