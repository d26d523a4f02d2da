"""The GPU benchmark's parts that run without a GPU: its arithmetic (TFLOP/s, ratios, the
hidden fraction of two streams) on CPU tensors with a fake timer, one error row per failing
variant, and the refusal without CUDA."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from distllm.bench import gpu_bench


def _fake_timer(ms: dict[str, float], calls: list[str]):
    """A timer that runs ``fn`` and reports the time scripted for it (looked up by the
    variant name the benchmark bound it to)."""
    names = {}

    def timer(fn):
        fn()
        name = names.get(fn)
        calls.append(name)
        return ms.get(name, 1.0)

    return timer, names


def test_linear_gelu_rows_math_with_a_fake_timer(monkeypatch):
    scripted = {"unfused": 4.0, "peer-addmm-activation": 2.0, "gemm-nobias": 1.0}
    calls: list[str] = []
    timer, names = _fake_timer(scripted, calls)
    real = gpu_bench.linear_gelu_variants

    def named(x, w, b):
        vs = real(x, w, b)
        names.update({fn: n for n, fn in vs.items()})
        return vs

    monkeypatch.setattr(gpu_bench, "linear_gelu_variants", named)
    M, K, N = 7, 16, 24
    rows = gpu_bench.bench_linear_gelu([(M, K, N)], torch.float32, "cpu", timer, reps=5, warmup=2)
    by = {r["variant"]: r for r in rows}
    # fused-cuda cannot run on CPU tensors: an error row with the reason, not a crash
    assert by["fused-cuda"]["status"] == "error" and "backend='cuda'" in by["fused-cuda"]["reason"]
    for name, ms in scripted.items():
        r = by[name]
        assert r["status"] == "ok" and r["reps"] == 5
        assert r["ms"] == r["ms_p10"] == r["ms_p90"] == ms
        assert r["tflops"] == pytest.approx(2 * M * K * N / (ms * 1e-3) / 1e12)
        assert r["speedup_vs_unfused"] == pytest.approx(4.0 / ms)
    assert calls.count("unfused") == 2 + 5  # warm-up rounds, then the timed repetitions


def test_chunk_penalty_rows_and_result():
    ms = iter(itertools.cycle([2.0, 3.0]))  # one-gemm, chunked alternate (A B, B A, ...)

    def timer(fn):
        fn()
        return next(ms)

    rows = gpu_bench.bench_chunk_penalty(16, 4, torch.float32, "cpu", timer, reps=4, warmup=1)
    assert {r["variant"] for r in rows} == {"one-gemm", "4-chunk-gemms"}
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
    # the chunked GEMMs compute the same product as the one GEMM
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    c = torch.empty(16, 16)
    from distllm.parallel.tensor.overlap import chunk_bounds

    for s, e in chunk_bounds(16, 4):
        torch.mm(a[s:e], b, out=c[s:e])
    torch.testing.assert_close(c, a @ b)


@pytest.mark.parametrize(
    "t_a,t_b,t_both,want",
    [
        (1.0, 1.0, 1.0, 1.0),  # fully concurrent
        (1.0, 1.0, 2.0, 0.0),  # serialised
        (2.0, 1.0, 2.5, 0.5),  # half of the shorter hidden
        (1.0, 1.0, 0.5, 1.0),  # faster than either alone (noise): clipped
        (1.0, 1.0, 3.0, 0.0),  # slower than both in a row (noise): clipped
        (0.0, 1.0, 1.0, 0.0),
    ],
)
def test_overlap_fraction(t_a, t_b, t_both, want):
    assert gpu_bench.overlap_fraction(t_a, t_b, t_both) == pytest.approx(want)


def test_main_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_parallel_mlp_rows_on_cpu_tensors():
    """The MLP measurement's rows on CPU tensors (the real timer of the wall clock): the
    unfused variant runs, the CUDA backend is an error row naming why, the ratios and
    TFLOP/s follow from the medians."""
    from distllm.diagnostics.timing import wall_timer

    m, h, f = 8, 16, 32
    one_device = types.SimpleNamespace(tp=1, tp_rank=0, tp_group=None)  # no process group here
    rows = gpu_bench.bench_parallel_mlp((m, h, f), torch.float32, "cpu", wall_timer(), reps=2,
                                        warmup=1, dims=one_device)
    assert not torch.distributed.is_initialized()  # the test process stays free of a world
    by = {r["variant"]: r for r in rows}
    assert by["fused-cuda"]["status"] == "error", by["fused-cuda"]
    assert "backend='cuda'" in by["fused-cuda"]["reason"]
    un = by["unfused"]
    assert un["status"] == "ok" and un["speedup_vs_unfused"] == pytest.approx(1.0)
    assert un["tflops"] == pytest.approx(12 * m * h * f / (un["ms"] * 1e-3) / 1e12)
