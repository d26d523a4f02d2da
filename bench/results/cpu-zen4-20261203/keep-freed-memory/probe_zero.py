"""dp2 steps of distllm ZeRO-2 (parameter gathers overlapped with the next forward, and
waited at once), distllm zero 0 and torch DDP, on 2 gloo ranks of one thread.

    probe_zero.py [L,H,B,S,M] [REPS] [--no-keep] [--profile]

Times: the variants interleaved, each step timed as the middle of three (the slowest
rank's), with the step thread's CPU time. ``--profile``: operator self-CPU times of rank 0,
averaged over REPS profiled steps (the gathers a step leaves in flight are waited for inside
the profiler). ``--no-keep``: glibc's default malloc thresholds (no keep_freed_memory).
"""

import collections
import statistics
import sys
import time

import torch
import torch.distributed as dist

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
SHAPE = tuple(int(v) for v in (ARGS[0] if ARGS else "6,768,8,64,4").split(","))
REPS = int(ARGS[1]) if len(ARGS) > 1 else 8
PROFILE = "--profile" in sys.argv


def _variants(dims):
    from distllm.bench.train_e2e import model_of
    from distllm.bench.train_e2e_variants import _engine_step, _torch_dp

    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine

    cfg, _ = model_of(SHAPE)
    _, _, batch, seq, _ = SHAPE

    def eng(zero, overlap=True):
        par = ParallelConfig(dp=2, zero=zero)
        tc = TrainConfig(model="tiny", parallel=par, global_batch=batch, seq_len=seq,
                         steps=10, progress=False)
        e = Engine(tc, cfg, dims)
        if e.zero is not None and not overlap:  # gathers waited for at the end of step
            for h in e.zero._gathers.hooks:
                h.remove()
            e.zero._gathers.hooks = []
        gen = torch.Generator().manual_seed(1 + dims.dp_rank)
        return _engine_step(e, torch.randint(0, cfg.vocab_size, (batch // 2, seq), generator=gen))

    out = {"zero2": eng(2), "zero0": eng(0), "torch_ddp": _torch_dp("ddp", cfg, batch, seq, dims)}
    if not PROFILE:
        out["zero2_noov"] = eng(2, False)
    return out


def _drain(step):
    e = getattr(step, "engine", None)
    if e is not None and e.zero is not None:
        e.zero.wait_params()


def _time(variants):
    names = list(variants)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for r in range(REPS):
        for n in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            variants[n]()
            t0, c0 = time.perf_counter(), time.thread_time()
            variants[n]()
            t1, c1 = time.perf_counter(), time.thread_time()
            variants[n]()
            _drain(variants[n])
            w = torch.tensor([(t1 - t0) * 1e3])
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            wall[n].append(float(w))
            cpu[n].append((c1 - c0) * 1e3)
    return {n: (statistics.median(wall[n]), min(wall[n]), max(wall[n]),
                statistics.median(cpu[n])) for n in names}


def _profile(variants):
    from torch.profiler import ProfilerActivity, profile

    agg = {n: collections.Counter() for n in variants}
    cnt = {n: collections.Counter() for n in variants}
    for _ in range(REPS):
        for n, f in variants.items():
            dist.barrier()
            f()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                f()
                _drain(f)  # no gloo thread may record an event while the profiler stops
            for ev in prof.key_averages():
                agg[n][ev.key] += ev.self_cpu_time_total / 1e3 / REPS
                cnt[n][ev.key] += ev.count / REPS
    return agg, cnt


def rank_fn():
    from distllm import ParallelDims
    from distllm.train.host_memory import keep_freed_memory

    if "--no-keep" not in sys.argv:
        keep_freed_memory()
    variants = _variants(ParallelDims(dp=2))
    for f in variants.values():  # warm-up
        f()
        f()
        _drain(f)
    return _profile(variants) if PROFILE else _time(variants)


def _print_profile(agg, cnt):
    keys = set().union(*[set(a) for a in agg.values()])
    top = sorted(keys, key=lambda k: -max(agg[n][k] for n in agg))[:40]
    print(f"{'op (self CPU ms x calls)':45s}" + "".join(f"{n:>16s}" for n in agg))
    for k in top:
        print(f"{k[:45]:45s}" + "".join(f"{agg[n][k]:9.1f} x{cnt[n][k]:5.0f}" for n in agg))
    print("total", [round(sum(a.values()), 1) for a in agg.values()])


if __name__ == "__main__":
    from distllm.testing import run_distributed

    res = run_distributed(rank_fn, 2, timeout=3000)
    if PROFILE:
        _print_profile(*res[0])
        sys.exit()
    for r, d in enumerate(res):
        for n, (med, lo, hi, c) in d.items():
            print(f"rank{r} {n:12s} wall med {med:7.1f} (min {lo:7.1f} max {hi:7.1f})"
                  f"  thread cpu {c:7.1f}")
    ddp = res[0]["torch_ddp"][0]
    for n, v in res[0].items():
        print(f"{n:12s} speed vs torch DDP {ddp / v[0]:.3f}")
