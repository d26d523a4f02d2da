"""``distllm plan --calibrate``: measure this machine and write a hardware profile.

Measured, one thread per rank (as ``distllm train`` runs its ranks):
  * GEMM FLOP/s per dtype: the best of a few square shapes is the ``peak``; the median over
    transformer-like shapes (tokens x h x 3h, tokens x h x 4h, tokens x 4h x h for the ``tiny``
    width) over that peak is ``matmul_efficiency``;
  * memory bandwidth: a large out-of-place add (3 streams);
  * per-operator overhead: a tiny forward + backward divided by its operator count;
  * gloo links: all-reduce time over a range of sizes on 2 ranks, fitted to the ring model
    ``2(n-1)*alpha + 2(n-1)/n * bytes * beta`` (4 ranks, as the ``tiny`` validation runs),
    on loopback (``intra``) and on the emulated
    network (``inter``, when it can be built; else a copy of loopback, said in ``source``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from .hardware import PROFILE_DIR, Link, Profile

__all__ = ["calibrate", "calibrate_cli", "fit_alpha_beta"]

AR_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _median_time(fn, reps: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after ``warmup`` more."""
    from distllm.diagnostics.timing import interleaved

    return interleaved({"fn": fn}, warmup=warmup, reps=reps)["fn"].median_ms * 1e-3


def measure_gemm(dtype: str = "float32", hidden: int = 128, tokens: int = 4096) -> dict:
    import torch

    dt = getattr(torch, dtype)
    rates = {}
    shapes = {
        "square512": (512, 512, 512),
        "square1024": (1024, 1024, 1024),
        "qkv": (tokens, hidden, 3 * hidden),
        "fc1": (tokens, hidden, 4 * hidden),
        "fc2": (tokens, 4 * hidden, hidden),
    }
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        t = _median_time(lambda a=a, b=b: torch.mm(a, b), reps=5)
        rates[name] = 2.0 * m * k * n / t
    peak = max(rates["square512"], rates["square1024"])
    model = statistics.median([rates[k] for k in ("qkv", "fc1", "fc2")])
    return {"peak": peak, "efficiency": min(1.0, model / peak), "rates": rates}


# The per-operator overhead is what the cost model adds for every eager operator of a
# block, in forward and (twice) in backward (``timing.OPS_PER_LAYER_FWD``): host time with
# autograd in the loop, not a bare kernel launch. So it is timed on a tiny training step whose
# arithmetic is negligible: x (4, 8) @ w (8, 8) -> GeLU -> sum, forward and backward, about
# 8 operators (mm, gelu, sum; their 5 backward kernels).
OP_PROBE_OPS = 8
OP_PROBE = ("measured: a tiny eager forward + backward (x (4, 8) @ w (8, 8) -> GeLU -> sum, "
            f"autograd included), time per step / {OP_PROBE_OPS} operators")


def measure_memory_and_ops() -> tuple[float, float]:
    """(memory bandwidth in bytes/s, per-operator overhead in s; see ``OP_PROBE``)."""
    import torch

    n = 1 << 24
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    t = _median_time(lambda: torch.add(a, b, out=c), reps=5)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def tiny_step():
        torch.nn.functional.gelu(x @ w).sum().backward()

    t_op = _median_time(lambda: [tiny_step() for _ in range(200)], reps=5) / 200 / OP_PROBE_OPS
    return 3 * 4 * n / t, t_op


def _ar_rank(sizes: tuple[int, ...], reps: int) -> dict:
    """Median seconds of a float32 all-reduce of each size (each repetition the slowest
    rank's)."""
    from distllm.diagnostics.timing import time_collective

    return {nbytes: statistics.median(time_collective("all_reduce", nbytes // 4, reps=reps))
            * 1e-3 for nbytes in sizes}


def fit_alpha_beta(times: dict[int, float], n: int) -> tuple[float, float]:
    """(alpha, beta) of ring all-reduce times ``{bytes: seconds}`` on n ranks, fitted by least
    squares on the relative error (small messages weigh as much as large ones)."""
    k = 2 * (n - 1)
    rows = [(k / t, k / n * s / t) for s, t in times.items()]  # model/t = 1 for each point
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    ra, rb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha = (ra * sbb - rb * sab) / det
    beta = (saa * rb - sab * ra) / det
    if alpha <= 0 or beta <= 0:  # degenerate: fall back to the two end points
        (s0, t0), (s1, t1) = min(times.items()), max(times.items())
        beta = max((t1 - t0) / (k / n * (s1 - s0)), 1e-15)
        alpha = max((t0 - beta * k / n * s0) / k, 1e-7)
    return alpha, beta


def measure_link(net_rate: str | None, nranks: int = 4, reps: int = 15) -> tuple[Link, str]:
    from distllm.testing import run_distributed

    if net_rate is None:
        res = run_distributed(_ar_rank, nranks, AR_SIZES, reps, timeout=300)
        where = f"gloo all-reduce on loopback, {nranks} ranks, 1 thread each"
    else:
        from distllm.testing.netem import EmulatedNetwork

        with EmulatedNetwork(nranks=nranks, rate=net_rate) as net:
            if not net.available:
                return None, f"emulated network unavailable ({net.reason})"
            res = run_distributed(
                _ar_rank, nranks, AR_SIZES, reps, timeout=300, setup=net.setup, env=net.env
            )
        where = f"gloo all-reduce on the emulated {net_rate} network, {nranks} ranks"
    times = {s: max(r[s] for r in res) for s in AR_SIZES}
    alpha, beta = fit_alpha_beta(times, nranks)
    pts = ", ".join(f"{s >> 10} KiB: {t * 1e3:.2f} ms" for s, t in times.items())
    return Link(
        1.0 / beta, alpha, 1.0, 0.0, f"measured: {where} ({pts}); ring fit on relative error"
    ), ""


def calibrate(net_rate: str | None = "1gbit", ranks: int = 4) -> Profile:
    """Measure this machine; ``ranks`` is how many rank processes share its cores."""
    import torch

    torch.set_num_threads(1)
    g32, g64 = measure_gemm("float32"), measure_gemm("float64")
    g16 = measure_gemm("bfloat16")
    bw, t_op = measure_memory_and_ops()
    intra, _ = measure_link(None)
    intra = dataclasses.replace(intra, uses_cpu=True)  # loopback TCP: the cores move the bytes
    inter, why = measure_link(net_rate) if net_rate else (None, "no --net given")
    if inter is None:
        inter = dataclasses.replace(intra, source=f"copy of loopback: {why}")
    else:  # a rate-limited link leaves the CPU free: chunked overlap can hide part of it
        inter = Link(
            inter.bandwidth,
            inter.latency,
            1.0,
            0.5,
            inter.source + "; overlap 0.5 assumed (chunked GEMM + all-reduce)",
        )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return Profile(
        name="cpu",
        description=f"this machine: {cores} cores, gloo, one thread per rank",
        peak_flops={"float32": g32["peak"], "float64": g64["peak"], "bfloat16": g16["peak"]},
        matmul_efficiency=g32["efficiency"],
        memory_bytes=mem / ranks,
        usable_memory_fraction=0.9,
        memory_bandwidth=bw,
        gpus_per_node=ranks,
        op_overhead_s=t_op,
        cores=cores,
        links={"intra": intra, "inter": inter},
        source={
            "calibrated": when,
            "peak_flops": "measured torch.mm, 1 thread, best of 512^3 and 1024^3",
            "matmul_efficiency": f"median of tiny-width GEMMs over peak: "
            f"{ {k: round(v / 1e9, 2) for k, v in g32['rates'].items()} } GFLOP/s",
            "memory_bandwidth": "measured out-of-place add of 64 MiB tensors",
            "op_overhead_s": OP_PROBE,
            "memory_bytes": f"host RAM / {ranks} ranks",
            "note": "taken on a shared machine; re-run on an idle one for stable numbers",
        },
    )


def calibrate_cli(args: argparse.Namespace) -> int:
    prof = calibrate(args.net or None, ranks=args.gpus if args.gpus else 4)
    out = Path(args.out) if args.out else PROFILE_DIR / "cpu.json"
    out.write_text(json.dumps(prof.to_json(), indent=1) + "\n")
    p = prof
    print(
        f"wrote {out}: float32 {p.peak_flops['float32'] / 1e9:.1f} GFLOP/s "
        f"(model-shape efficiency {p.matmul_efficiency:.2f}), memory "
        f"{p.memory_bandwidth / 1e9:.1f} GB/s, op {p.op_overhead_s * 1e6:.1f} us, loopback "
        f"{p.links['intra'].bandwidth / 1e9:.2f} GB/s + {p.links['intra'].latency * 1e6:.0f} us, "
        f"inter {p.links['inter'].bandwidth / 1e9:.3f} GB/s + "
        f"{p.links['inter'].latency * 1e6:.0f} us"
    )
    return 0
