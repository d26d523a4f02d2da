"""A synthetic benchmark module for the suite tests: fast, and certain in who wins.

``run`` times three sleeps through the shared harness, 20 ms ("unfused"), 2 ms ("fused")
and 30 ms ("torch_peer"), far enough apart that a loaded machine cannot reorder them, and
reports a variant that cannot run here; the fused row carries a timeline. ``cases`` lists
the shapes so that the runner steps through them one by one.
"""

from __future__ import annotations

import time

from distllm.bench.harness import BenchConfig, interleaved, row


def _sleep(ms: float) -> None:
    time.sleep(ms * 1e-3)


def cases(cfg: BenchConfig) -> list[str]:
    return cfg.shapes.split(";") if cfg.shapes and "," in cfg.shapes else ["1,2,3", "4,5,6"]


def run(cfg: BenchConfig) -> list[dict]:
    case = cfg.shapes or "1,2,3"
    st = interleaved({"unfused": lambda: _sleep(20.0), "fused": lambda: _sleep(2.0),
                      "torch_peer": lambda: _sleep(30.0)}, warmup=1, reps=cfg.reps or 5)
    tl = [{"lane": "compute", "name": "gemm 0", "start_ms": 0.0, "end_ms": 1.0},
          {"lane": "compute", "name": "gemm 1", "start_ms": 1.0, "end_ms": 2.0},
          {"lane": "comm", "name": "ar 0", "start_ms": 1.0, "end_ms": 2.2}]
    return [
        row("fake", case, "unfused", st["unfused"], flops=1e6),
        row("fake", case, "fused", st["fused"], flops=1e6, hidden_frac=0.8,
            timeline=tl),
        row("fake", case, "torch_peer", st["torch_peer"], flops=1e6),
        row("fake", case, "fused_cuda", status="unavailable", reason="needs a CUDA device"),
    ]

