"""dp2 step times, interleaved in one process: distllm ZeRO-2 (parameter gathers overlapped
with the next forward, and waited at once), distllm zero 0 and torch DDP; each timed as the
middle of three steps, the slowest rank's. Usage: probe_zero.py [L,H,B,S,M] [REPS] [--no-keep]."""

import statistics
import sys
import time

import torch
import torch.distributed as dist

SHAPE = tuple(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "6,768,8,64,4").split(","))
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 8


def rank_fn():
    from distllm.train.host_memory import keep_freed_memory

    if "--no-keep" not in sys.argv:
        keep_freed_memory()
    from distllm.bench.train_e2e import model_of
    from distllm.bench.train_e2e_variants import _engine_step, _torch_dp

    from distllm import ParallelDims
    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine

    dims = ParallelDims(dp=2)
    cfg, _ = model_of(SHAPE)
    _, _, batch, seq, m = SHAPE

    def eng(zero, overlap=True):
        tc = TrainConfig(
            model="tiny",
            parallel=ParallelConfig(dp=2, zero=zero),
            global_batch=batch,
            seq_len=seq,
            steps=10,
            progress=False,
        )
        e = Engine(tc, cfg, dims)
        if e.zero is not None and not overlap:
            for h in e.zero._gathers.hooks:
                h.remove()
            e.zero._gathers.hooks = []
        x = torch.randint(
            0,
            cfg.vocab_size,
            (batch // 2, seq),
            generator=torch.Generator().manual_seed(1 + dims.dp_rank),
        )
        return _engine_step(e, x)

    variants = {
        "zero2": eng(2),
        "zero2_noov": eng(2, False),
        "zero0": eng(0),
        "torch_ddp": _torch_dp("ddp", cfg, batch, seq, dims),
    }
    names = list(variants)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}

    def drain(n):
        e = getattr(variants[n], "engine", None)
        if e is not None and e.zero is not None:
            e.zero.wait_params()

    for n in names:  # warm-up
        variants[n]()
        variants[n]()
        drain(n)
    for r in range(REPS):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            dist.barrier()
            variants[n]()
            t0, c0 = time.perf_counter(), time.thread_time()
            variants[n]()
            t1, c1 = time.perf_counter(), time.thread_time()
            variants[n]()
            drain(n)
            w = torch.tensor([(t1 - t0) * 1e3])
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            wall[n].append(float(w))
            cpu[n].append((c1 - c0) * 1e3)
    return {
        n: (statistics.median(wall[n]), min(wall[n]), max(wall[n]), statistics.median(cpu[n]))
        for n in names
    }


if __name__ == "__main__":
    from distllm.testing import run_distributed

    res = run_distributed(rank_fn, 2, timeout=3000)
    for r, d in enumerate(res):
        for n, (med, lo, hi, c) in d.items():
            print(
                f"rank{r} {n:12s} wall med {med:7.1f} (min {lo:7.1f} max {hi:7.1f})"
                f"  thread cpu {c:7.1f}"
            )
    ddp = res[0]["torch_ddp"][0]
    for n, v in res[0].items():
        print(f"{n:12s} speed vs torch DDP {ddp / v[0]:.3f}")
