"""Synthetic suites for the runner and registry tests: fast, and certain in who wins.

The ``fake`` suite times three sleeps, 20 ms ("unfused"), 2 ms ("fused") and 30 ms
("torch_peer"), far enough apart that a loaded machine cannot reorder them, and reports a
variant that cannot run here; the fused row carries a timeline. Its cases are the shapes
(``--shapes`` or two presets), so the runner steps through them one by one.
"""

from __future__ import annotations

import time

from distllm.bench.harness import BenchConfig, Case, Result, Setup, shapes
from distllm.bench.rows import row

SUITE = "fake"
PRESETS = [(1, 2, 3), (4, 5, 6)]


def _sleep(ms: float) -> None:
    time.sleep(ms * 1e-3)


def cases(cfg: BenchConfig) -> list[Case]:
    return [Case(",".join(map(str, s)), {"shape": s}) for s in shapes(cfg, PRESETS)]


def setup(cfg: BenchConfig, case: Case) -> Setup:
    return Setup({"unfused": lambda: _sleep(20.0), "fused": lambda: _sleep(2.0),
                  "torch_peer": lambda: _sleep(30.0)},
                 unavailable={"fused_cuda": "needs a CUDA device"}, warmup=1,
                 reps=cfg.reps or 5)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    st = result.stats
    tl = [{"lane": "compute", "name": "gemm 0", "start_ms": 0.0, "end_ms": 1.0},
          {"lane": "compute", "name": "gemm 1", "start_ms": 1.0, "end_ms": 2.0},
          {"lane": "comm", "name": "ar 0", "start_ms": 1.0, "end_ms": 2.2}]
    return [
        row(SUITE, case.label, "unfused", st["unfused"], flops=1e6),
        row(SUITE, case.label, "fused", st["fused"], flops=1e6, hidden_frac=0.8, timeline=tl),
        row(SUITE, case.label, "torch_peer", st["torch_peer"], flops=1e6),
        *[row(SUITE, case.label, n, status="unavailable", reason=why)
          for n, why in result.unavailable.items()],
    ]
