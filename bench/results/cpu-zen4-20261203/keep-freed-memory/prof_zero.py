"""Operator self-CPU times of one dp2 step of distllm ZeRO-2, distllm zero 0 and torch DDP
(rank 0, averaged over REPS profiled steps). Usage: prof_zero.py [REPS] [--no-keep]."""

import collections
import sys

import torch
import torch.distributed as dist

SHAPE = (6, 768, 8, 64, 4)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def rank_fn():
    from distllm.train.host_memory import keep_freed_memory

    if "--no-keep" not in sys.argv:
        keep_freed_memory()
    from distllm.bench.train_e2e import model_of
    from distllm.bench.train_e2e_variants import _engine_step, _torch_dp
    from torch.profiler import ProfilerActivity, profile

    from distllm import ParallelDims
    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine

    dims = ParallelDims(dp=2)
    cfg, _ = model_of(SHAPE)
    _, _, batch, seq, m = SHAPE

    def eng(zero):
        tc = TrainConfig(
            model="tiny",
            parallel=ParallelConfig(dp=2, zero=zero),
            global_batch=batch,
            seq_len=seq,
            steps=10,
            progress=False,
        )
        e = Engine(tc, cfg, dims)
        x = torch.randint(
            0,
            cfg.vocab_size,
            (batch // 2, seq),
            generator=torch.Generator().manual_seed(1 + dims.dp_rank),
        )
        return _engine_step(e, x)

    import os

    allv = {
        "zero2": lambda: eng(2),
        "zero0": lambda: eng(0),
        "ddp": lambda: _torch_dp("ddp", cfg, batch, seq, dims),
    }
    variants = {k: allv[k]() for k in os.environ.get("VARS", "zero2,zero0,ddp").split(",")}
    agg = {n: collections.Counter() for n in variants}
    cnt = {n: collections.Counter() for n in variants}
    for f in variants.values():
        f()
        f()
    for _r in range(REPS):
        for n, f in variants.items():
            dist.barrier()
            f()
            e = getattr(f, "engine", None)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                f()
                if e is not None and e.zero is not None:
                    e.zero.wait_params()
            for ev in prof.key_averages():
                agg[n][ev.key] += ev.self_cpu_time_total / 1e3 / REPS
                cnt[n][ev.key] += ev.count / REPS
    return agg, cnt


if __name__ == "__main__":
    from distllm.testing import run_distributed

    res = run_distributed(rank_fn, 2, timeout=3000)
    agg, cnt = res[0]
    keys = set().union(*[set(a) for a in agg.values()])
    rows = sorted(keys, key=lambda k: -max(agg[n][k] for n in agg))[:40]
    print(f"{'op':45s}" + "".join(f"{n:>16s}" for n in agg))
    for k in rows:
        print(f"{k[:45]:45s}" + "".join(f"{agg[n][k]:9.1f} x{cnt[n][k]:5.0f}" for n in agg))
    print("total", [round(sum(a.values()), 1) for a in agg.values()])
