"""The GPU benchmark's parts that run without a GPU: its arithmetic (TFLOP/s, ratios, the
hidden fraction of two streams) on CPU tensors with a fake timer, one error row per failing
variant, the refusal without CUDA, the results file written after each measurement, and
bench/gpu_check.sh up to its stop on a machine without a GPU (with a stand-in Python)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from distllm.bench import gpu_bench, report


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
    # the bare GEMM is the floor, a part: no contender in the report
    assert by["gemm-nobias"]["extra"]["role"] == "part"
    assert report.role_of(by["gemm-nobias"]) == "part"
    assert {report.role_of(by[n]) for n in ("unfused", "fused-cuda")} == {"unfused", "fused"}


def test_a_cuda_row_that_fell_back_is_an_error_row_not_cublaslts_figure():
    from distllm.ops import linear_gelu_backends

    x, w = torch.zeros(4, 8), torch.zeros(8, 8)

    def fell_back():  # what fwd does when cuBLASLt offers no algorithm: says so, runs another
        linear_gelu_backends._after_cuda(x, w, "tanh", "forward", NotImplementedError("none"))

    calls: list[str] = []
    timer, names = _fake_timer({"unfused": 2.0, "fused-cuda": 1.0}, calls)
    variants = {"unfused": lambda: None, "fused-cuda": fell_back}
    names.update({fn: n for n, fn in variants.items()})
    rows = gpu_bench._timed_rows("case", variants, timer, 3, 1, 1.0, "unfused")
    by = {r["variant"]: r for r in rows}
    assert by["unfused"]["status"] == "ok"
    assert by["fused-cuda"]["status"] == "error" and "fell back" in by["fused-cuda"]["reason"]
    # a case where cuBLASLt ran keeps its row (the fallback record is per case)
    variants = {"unfused": lambda: None, "fused-cuda": lambda: None}
    names.update({fn: n for n, fn in variants.items()})
    rows = gpu_bench._timed_rows("case", variants, timer, 3, 1, 1.0, "unfused")
    assert {r["variant"]: r["status"] for r in rows} == {"unfused": "ok", "fused-cuda": "ok"}


def test_chunk_penalty_rows_and_result(monkeypatch):
    """Both variants' rows are parts; every call of each leaves ``a @ b`` in the output
    tensor the benchmark times (zeroed before each call)."""
    ms = iter(itertools.cycle([2.0, 3.0]))  # one-gemm, chunked alternate (A B, B A, ...)
    real, seen = gpu_bench.chunk_penalty_variants, {}

    def capture(a, bm, c, chunks):
        vs = real(a, bm, c, chunks)
        seen.update(a=a, b=bm, out=c, names={fn: n for n, fn in vs.items()})
        return vs

    checked = []

    def timer(fn):
        seen["out"].zero_()
        fn()
        torch.testing.assert_close(seen["out"], seen["a"] @ seen["b"])
        checked.append(seen["names"][fn])
        return next(ms)

    monkeypatch.setattr(gpu_bench, "chunk_penalty_variants", capture)
    rows = gpu_bench.bench_chunk_penalty(16, 4, torch.float32, "cpu", timer, reps=4, warmup=1)
    assert {r["variant"] for r in rows} == {"one-gemm", "4-chunk-gemms"}
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
    assert sorted(checked) == ["4-chunk-gemms"] * 5 + ["one-gemm"] * 5
    assert [r["extra"]["role"] for r in rows] == ["part", "part"] and "role" not in rows[0]
    assert {report.role_of(r) for r in rows} == {"part"}


@pytest.mark.parametrize(
    "t_a,t_b,t_both,want",
    [
        (1.0, 1.0, 1.0, 1.0),  # fully concurrent
        (1.0, 1.0, 2.0, 0.0),  # serialised
        (2.0, 1.0, 2.5, 0.5),  # half of the shorter hidden
        (1.0, 1.0, 0.5, 1.5),  # faster than either alone: a measurement error, kept
        (1.0, 1.0, 3.0, -1.0),  # slower than both in a row: a measurement error, kept
        (0.0, 1.0, 1.0, None),  # no shorter kernel: no fraction
    ],
)
def test_overlap_fraction(t_a, t_b, t_both, want):
    got = gpu_bench.overlap_fraction(t_a, t_b, t_both)
    assert got is None if want is None else got == pytest.approx(want)


def test_two_streams_rows_mark_fractions_outside_zero_to_one(monkeypatch):
    """The child's fractions are rows with ceiling 1 and floor 0, flagged beyond either."""
    out = {"gemm": 10.0, "elementwise": 5.0, "hidden_gemm_then_elementwise": 2.2,
           "hidden_elementwise_then_gemm": -0.4, "hidden_x": 0.5, "hidden_y": None}
    done = types.SimpleNamespace(returncode=0, stdout=json.dumps(out), stderr="")
    monkeypatch.setattr(gpu_bench.subprocess, "run", lambda *a, **k: done)
    rows = gpu_bench.two_streams_rows(3)
    assert len(rows) == 12  # two children
    by = {r["variant"]: r for r in rows[:6]}
    assert by["gemm"]["ms"] == 10.0 and by["gemm"]["hidden_frac"] is None
    flags = {n: (by[n]["hidden_frac"], by[n]["extra"].get("above_ceiling"),
                 by[n]["extra"].get("below_floor")) for n in out if n.startswith("hidden_")}
    assert flags == {"hidden_gemm_then_elementwise": (2.2, True, False),
                     "hidden_elementwise_then_gemm": (-0.4, False, True),
                     "hidden_x": (0.5, False, False), "hidden_y": (None, None, None)}
    table = report.suite_table(report.annotate(rows))
    assert "220% ⚠" in table and "-40% ⚠" in table and report.CEILING_NOTE in table
    assert report.FLOOR_NOTE in table


def _fake_steps(monkeypatch, fail_at: str = ""):
    """Each measurement of run_all as one synthetic row; ``fail_at`` raises
    KeyboardInterrupt there (as SIGINT from ``timeout -s INT`` does)."""
    def step(name):
        def run(*a, **k):
            if name == fail_at:
                raise KeyboardInterrupt
            return [gpu_bench.row("gpu", name, "x", status="ok", ms=1.0)]
        return run

    for fn in ("bench_linear_gelu", "bench_parallel_mlp", "bench_chunk_penalty",
               "two_streams_rows"):
        monkeypatch.setattr(gpu_bench, fn, step(fn))
    monkeypatch.setattr(gpu_bench, "machine_info", lambda: {"gpu": "fake"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_results_are_written_after_each_measurement(monkeypatch, tmp_path):
    _fake_steps(monkeypatch)
    seen = []
    rows = gpu_bench.run_all(linear_shapes=[(1, 2, 3)], progress=lambda r, left: seen.append(
        ([x["case"] for x in r], list(left))))
    # the measurements that compile nothing first (a run cut short loses the tuning ones)
    assert len(rows) == 4 and seen == [
        ([], ["chunk_penalty", "two_streams", "linear_gelu (1, 2, 3)", "parallel_mlp"]),
        (["bench_chunk_penalty"], ["two_streams", "linear_gelu (1, 2, 3)", "parallel_mlp"]),
        (["bench_chunk_penalty", "two_streams_rows"], ["linear_gelu (1, 2, 3)",
                                                       "parallel_mlp"]),
        (["bench_chunk_penalty", "two_streams_rows", "bench_linear_gelu"], ["parallel_mlp"]),
        (["bench_chunk_penalty", "two_streams_rows", "bench_linear_gelu",
          "bench_parallel_mlp"], [])]
    out = tmp_path / "r" / "results.json"
    assert gpu_bench.main(["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["left"] == [] and len(data["rows"]) == 5
    assert [p.name for p in out.parent.iterdir()] == ["results.json"]  # no temporary left


def test_an_interrupted_benchmark_keeps_what_it_measured(monkeypatch, tmp_path, capsys):
    _fake_steps(monkeypatch, fail_at="bench_parallel_mlp")
    out = tmp_path / "results.json"
    out.write_text("stale")
    assert gpu_bench.main(["--out", str(out)]) == 130
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["rows"]] == ["bench_chunk_penalty", "two_streams_rows"] + [
        "bench_linear_gelu"] * 2
    assert data["complete"] is False and data["interrupted"] == "SIGINT"
    assert data["left"] == ["parallel_mlp"]
    assert "not measured: parallel_mlp" in capsys.readouterr().err


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


_REPO = Path(__file__).resolve().parents[2]
_FAKE_PY = """#!/usr/bin/env bash
# a stand-in interpreter: no CUDA, every other call succeeds and prints a word
case "$*" in *torch.cuda.is_available*) exit 1;; esac
case "$*" in *"pip install"*) echo "${PATH%%:*}" > "$(dirname "$0")/build_path_head";; esac
echo fake
"""


def test_gpu_check_starts_from_an_empty_out_dir_and_interrupts_its_steps(tmp_path):
    """Every output file of an earlier run in OUT_DIR is removed first (here the script
    stops where a machine without a GPU does, after the build step, with a stand-in
    interpreter); the steps whose results survive a timeout get SIGINT, not SIGTERM."""
    script = _REPO / "bench" / "gpu_check.sh"
    out = tmp_path / "out"
    out.mkdir()
    stale = ["summary.log", "gpu_tests.xml", "results.json", "results.json.tmp", "info.json",
             "logs.tgz"]
    for name in stale:
        (out / name).write_text("from an earlier run")
    py = tmp_path / "py"
    py.write_text(_FAKE_PY)
    py.chmod(0o755)
    env = {**os.environ, "PY": str(py), "TMPDIR": str(tmp_path)}
    p = subprocess.run(["bash", str(script), str(out)], env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 1, p.stdout + p.stderr  # no GPU, and "distllm._cuda" not built
    left = {f.name: f.read_text(errors="replace") for f in out.iterdir()}
    assert "from an earlier run" not in left.values(), left
    assert set(left) <= set(stale) and "summary.log" in left
    assert "build rc=0, distllm._cuda up to date and loading: no" in left["summary.log"]
    # the build sees the interpreter's own bin first (ninja installed in a venv is found)
    assert (tmp_path / "build_path_head").read_text().strip() == str(tmp_path)
    text = script.read_text()
    assert "timeout -s INT -k 20 \"$t\" $PY -m pytest" in text
    assert "timeout -s INT -k 20 \"$t\" $PY -m distllm.bench.gpu_bench" in text
    assert all(name in text for name in stale)
