"""A synthetic benchmark module for the suite tests: fast, and certain in who wins.

``run`` times three busy-waits through the shared harness, 4 ms ("unfused"), 2 ms ("fused")
and 6 ms ("torch_peer"), and reports a variant that cannot run here; the fused row carries
a timeline. ``cases`` lists the shapes so that the runner steps through them one by one.
"""

from __future__ import annotations

import time

from distllm.bench.harness import BenchConfig, interleaved, row


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms * 1e-3
    while time.perf_counter() < end:
        pass


def cases(cfg: BenchConfig) -> list[str]:
    return cfg.shapes.split(";") if cfg.shapes and "," in cfg.shapes else ["1,2,3", "4,5,6"]


def run(cfg: BenchConfig) -> list[dict]:
    case = cfg.shapes or "1,2,3"
    st = interleaved({"unfused": lambda: _spin(4.0), "fused": lambda: _spin(2.0),
                      "torch_peer": lambda: _spin(6.0)}, warmup=1, reps=cfg.reps or 5)
    tl = [{"lane": "compute", "name": "gemm 0", "start_ms": 0.0, "end_ms": 1.0},
          {"lane": "compute", "name": "gemm 1", "start_ms": 1.0, "end_ms": 2.0},
          {"lane": "comm", "name": "ar 0", "start_ms": 1.0, "end_ms": 2.2}]
    return [
        row("fake", case, "unfused", st["unfused"], flops=1e6),
        row("fake", case, "fused", st["fused"], flops=1e6, hidden_frac=0.8,
            timeline=tl),
        row("fake", case, "torch_peer", st["torch_peer"], flops=1e6),
        row("fake", case, "cuda_only", status="unavailable", reason="needs a CUDA device"),
    ]

