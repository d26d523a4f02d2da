"""A synthetic 2-rank suite for the runner tests: rank 1 is slow, so the runner's timing
(the slowest rank's) is told apart from rank 0's own; each rank reports itself afterwards."""

from __future__ import annotations

import time

import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Case, Result, Setup
from distllm.bench.rows import row

SUITE = "fake_ranks"
SLOW_MS, FAST_MS = 40.0, 1.0


def cases(cfg: BenchConfig) -> list[Case]:
    return [Case("two ranks", ranks=2, networks=True, timeout=120)]


def setup(cfg: BenchConfig, case: Case) -> Setup:
    rank = dist.get_rank()
    ms = SLOW_MS if rank == 1 else FAST_MS
    calls = []

    def slow_on_rank1() -> None:
        calls.append(time.perf_counter())
        time.sleep(ms * 1e-3)

    def finish(stats) -> dict:
        return {"rank": rank, "world": dist.get_world_size(), "calls": len(calls),
                "net": case.net}

    return Setup({"slow_on_rank1": slow_on_rank1}, warmup=1, reps=3, finish=finish)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    st = result.stats["slow_on_rank1"]
    return [row(SUITE, f"{case.label} {result.net}", "slow_on_rank1", st, ms_min=st.min_ms,
                reason=result.net_reason, info=result.info)]
