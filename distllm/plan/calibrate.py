"""``distllm plan --calibrate``: measure this machine and write a hardware profile.

Measured, one thread per rank (as ``distllm train`` runs its ranks), compute in CPU time
(what a core does; other users' load stretches wall time, not this):
  * GEMM FLOP/s per dtype: the best of a few square shapes is the ``peak``; the median over
    transformer-like shapes (tokens x h x 3h, tokens x h x 4h, tokens x 4h x h for the ``tiny``
    width) over that peak is ``matmul_efficiency``;
  * memory bandwidth: a large out-of-place add (3 streams);
  * per-operator overhead: a tiny forward + backward divided by its operator count;
  * the attention core: causal SDPA forward + backward as a fraction of the GEMM peak;
  * GeLU per element, forward and backward, on a fresh GEMM output (as the eager step runs it);
  * core sharing: CPU time of fixed work in ``ranks`` processes at once over alone;
  * gloo links: all-reduce time over a range of sizes with every rank that shares the
    machine in it (``ranks``: 4 unless ``--gpus`` says otherwise, as the ``tiny`` validation
    runs; at least 2, a ring's least), fitted to the ring model
    ``2(n-1)*alpha + 2(n-1)/n * bytes * beta`` (:func:`fit_alpha_beta`: beta from the
    largest size, alpha from the small ones, never faster than the ``--net`` line rate), on
    loopback (``intra``) and on the emulated network (``inter``, when it can be built; else
    a copy of loopback, said in ``source``); and the same fit of each rank's CPU seconds
    per all-reduce (gloo's threads copying and summing: ``cpu_latency`` per ring step,
    ``cpu_per_byte``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import time
from pathlib import Path

from distllm.files import write_text_atomic

from .collectives import FIT, fit_alpha_beta
from .hardware import PROFILE_DIR, Link, Profile

__all__ = ["calibrate", "calibrate_cli", "fit_alpha_beta", "output_path", "write_profile"]

AR_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _median_time(fn, reps: int = 7, warmup: int = 2) -> float:
    """Median CPU seconds of this thread over ``reps`` calls of ``fn`` after ``warmup`` more.

    CPU time, not wall time: the compute terms are work a rank's core does, and on a shared
    machine other users' processes stretch the wall time of a call, not the CPU time it
    takes (``time.thread_time``; the kernels run on this one thread)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts)


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


# The attention core of a CPU rank is torch's fused scaled_dot_product_attention (causal);
# its FLOP rate at the validation's shape (b, a, s, d) = (4, 4, 128, 32) is far below the
# GEMMs', so the profile carries it as ``flash_efficiency`` (forward + backward, the causal
# half of the FLOPs, over the float32 peak).
ATTENTION_SHAPE = (4, 4, 128, 32)


def measure_attention(peak: float, shape: tuple[int, int, int, int] = ATTENTION_SHAPE) -> dict:
    """Fraction of ``peak`` that causal SDPA forward + backward reaches at ``shape``."""
    import torch
    import torch.nn.functional as F

    b, a, s, d = shape
    q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, a, s, d)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    t = _median_time(fwd_bwd, reps=9)
    flops = 3.5 * 4.0 * b * a * s * s * d * 0.5  # forward + 2.5x backward, causal half
    return {"efficiency": min(1.0, flops / t / peak), "ms": t * 1e3}


# GeLU (the tanh form, the model's default) is not memory-bound on a CPU core: tanh costs
# more than the bytes, and in the eager step its input is a GEMM's fresh output and its
# output a fresh allocation (first touch of new pages). So it is timed in that pattern:
# y = gelu(addmm(bias, x, w)) and its backward, per element of the MLP's inner activation.
GELU_SHAPE = (512, 128, 512)  # (tokens, hidden, ffn) of one validation rank's MLP


def measure_gelu(shape: tuple[int, int, int] = GELU_SHAPE) -> tuple[float, float]:
    """(forward, backward) seconds per element of GeLU (tanh) on a fresh GEMM output."""
    import torch
    import torch.nn.functional as F

    m, h, f = shape
    x, w, bias = torch.randn(m, h), torch.randn(h, f), torch.randn(f)
    grad = torch.randn(m, f)
    fwd, bwd = [], []
    for _ in range(25):
        pre = torch.addmm(bias, x, w)  # (m, h) @ (h, f): the pattern of the MLP's input GEMM
        t0 = time.thread_time()
        F.gelu(pre, approximate="tanh")
        t1 = time.thread_time()
        torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
        t2 = time.thread_time()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    n = m * f
    return statistics.median(fwd[3:]) / n, statistics.median(bwd[3:]) / n


def _sharing_work(reps: int) -> float:
    """CPU seconds of a fixed GEMM + GeLU loop in this rank (one thread)."""
    import torch
    import torch.nn.functional as F

    x, w = torch.randn(512, 512), torch.randn(512, 512)
    F.gelu(x @ w, approximate="tanh")
    t0 = time.process_time()
    for _ in range(reps):
        F.gelu(x @ w, approximate="tanh")
    return time.process_time() - t0


def measure_core_sharing(ranks: int, reps: int = 150) -> float:
    """CPU time of the same work when ``ranks`` processes share this machine's cores, over
    its CPU time alone (cache and context-switch losses of oversubscription; CPU time, so
    other users' load does not count, as long as it leaves the caches alone)."""
    from distllm.testing import run_distributed

    alone = min(run_distributed(_sharing_work, 1, reps)[0] for _ in range(2))
    # the least disturbed of two tries: other users' processes thrash the caches too
    shared = min(statistics.median(run_distributed(_sharing_work, ranks, reps))
                 for _ in range(2))
    return max(1.0, shared / alone)


def _ar_rank(sizes: tuple[int, ...], reps: int) -> dict:
    """Per size: median seconds of a float32 all-reduce, the one the layers run
    (:func:`distllm.comm.collectives.all_reduce`: gloo's ring, or one exchange on 2 ranks;
    each repetition the slowest rank's),
    and this rank's CPU seconds per all-reduce over ``reps`` back to back (its threads,
    gloo's included: the cores the collective takes from compute)."""
    import torch
    import torch.distributed as dist

    from distllm.comm.collectives import all_reduce
    from distllm.diagnostics.timing import time_collective

    out = {}
    for nbytes in sizes:
        wall = statistics.median(time_collective("all_reduce", nbytes // 4, reps=reps)) * 1e-3
        x = torch.zeros(nbytes // 4)
        dist.barrier()
        t0 = time.process_time()
        for _ in range(reps):
            all_reduce(x)
        out[nbytes] = (wall, (time.process_time() - t0) / reps)
    return out


def measure_link(net_rate: str | None, nranks: int = 4, reps: int = 15,
                 sizes: tuple[int, ...] = AR_SIZES) -> tuple[Link, str]:
    from distllm.testing import run_distributed
    from distllm.testing.netem import parse_rate

    if net_rate is None:
        res = run_distributed(_ar_rank, nranks, sizes, reps, timeout=300)
        where = f"gloo all-reduce on loopback, {nranks} ranks, 1 thread each"
    else:
        from distllm.testing.netem import EmulatedNetwork

        with EmulatedNetwork(nranks=nranks, rate=net_rate) as net:
            if not net.available:
                return None, f"emulated network unavailable ({net.reason})"
            res = run_distributed(
                _ar_rank, nranks, sizes, reps, timeout=300, setup=net.setup, env=net.env
            )
        where = f"gloo all-reduce on the emulated {net_rate} network, {nranks} ranks"
    times = {s: max(r[s][0] for r in res) for s in sizes}
    cpu = {s: statistics.median(r[s][1] for r in res) for s in sizes}
    # the emulated link's rate in bytes/s: no fit faster than the wire
    rate = parse_rate(net_rate) / 8 if net_rate is not None else None
    alpha, beta = fit_alpha_beta(times, nranks, rate)
    c_alpha, c_beta = fit_alpha_beta(cpu, nranks)
    pts = ", ".join(f"{s >> 10} KiB: {t * 1e3:.2f} ms" for s, t in times.items())
    cpts = ", ".join(f"{s >> 10} KiB: {t * 1e3:.2f} ms" for s, t in cpu.items())
    cap = f", at most the {net_rate} line rate" if rate else ""
    return Link(
        1.0 / beta, alpha, 1.0, 0.0,
        f"measured: {where} ({pts}); {FIT}{cap}; CPU seconds per rank (its threads, median "
        f"over ranks: {cpts}) fitted the same way",
        cpu_latency=c_alpha, cpu_per_byte=c_beta,
    ), ""


def calibrate(net_rate: str | None = "1gbit", ranks: int = 4) -> Profile:
    """Measure this machine; ``ranks`` is how many rank processes share its cores."""
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    g32, g64 = measure_gemm("float32"), measure_gemm("float64")
    g16 = measure_gemm("bfloat16")
    bw, t_op = measure_memory_and_ops()
    att = measure_attention(g32["peak"])
    gelu = measure_gelu()
    sharing = measure_core_sharing(ranks)
    # every rank of the machine in the collective, as in training (a ring needs two)
    link_ranks = max(2, ranks)
    intra, _ = measure_link(None, nranks=link_ranks)
    # loopback TCP: the cores move the bytes; gloo runs its ring (the fit's model) at any size
    intra = dataclasses.replace(intra, uses_cpu=True, tree=False)
    inter, why = (measure_link(net_rate, nranks=link_ranks) if net_rate
                  else (None, "no --net given"))
    if inter is None:
        inter = dataclasses.replace(intra, source=f"copy of loopback: {why}")
    else:  # a rate-limited link leaves the CPU free: chunked overlap can hide part of it
        inter = dataclasses.replace(
            inter, overlap=0.5, tree=False,
            source=inter.source + "; overlap 0.5 assumed (chunked GEMM + all-reduce)")
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
        flash_efficiency=att["efficiency"],
        gelu_s_per_element=gelu,
        core_sharing=sharing,
        links={"intra": intra, "inter": inter},
        source={
            "calibrated": when,
            "peak_flops": "measured torch.mm, 1 thread, best of 512^3 and 1024^3",
            "matmul_efficiency": f"median of tiny-width GEMMs over peak: "
            f"{ {k: round(v / 1e9, 2) for k, v in g32['rates'].items()} } GFLOP/s",
            "memory_bandwidth": "measured out-of-place add of 64 MiB tensors",
            "op_overhead_s": OP_PROBE,
            "flash_efficiency": f"measured: causal scaled_dot_product_attention forward + "
            f"backward at (b, a, s, d) = {ATTENTION_SHAPE}, 1 thread ({att['ms']:.2f} ms), "
            "3.5 x the causal half of 4*b*a*s*s*d FLOPs over the float32 peak",
            "gelu_s_per_element": "measured: gelu(approximate='tanh') and its backward on a "
            f"fresh addmm output of (tokens, hidden, ffn) = {GELU_SHAPE}, 1 thread, median "
            "per element",
            "core_sharing": f"measured: CPU time of a fixed 512^3 GEMM + GeLU loop in {ranks} "
            f"processes at once on {cores} cores over its CPU time alone",
            "links": "gloo all-reduce is a ring at every size (no tree): tree=false",
            "memory_bytes": f"host RAM / {ranks} ranks",
            "load": "1-minute load average as calibration began: "
            f"{load:.1f} on {cores} cores (uptime)",
            "note": "taken on a shared machine; re-run on an idle one for stable numbers",
        },
    )


CALIBRATE_RANKS = 4  # rank processes sharing the machine, as the ``tiny`` validation runs
DEFAULT_OUT = "cpu-calibrated.json"
"""``--out`` unless given: in the current directory, never over a packaged profile."""
DEFAULT_NET = "1gbit"  # the emulated link --calibrate measures unless --net says otherwise


def output_path(out: str | None) -> Path:
    """The profile file ``--out`` names (default :data:`DEFAULT_OUT`), checked before any
    measuring: a ``.json`` name (``--gpu`` reads a path by that suffix) in an existing
    folder, and not in the packaged profiles (:data:`PROFILE_DIR`), which a reinstall
    replaces."""
    path = Path(out or DEFAULT_OUT)
    if path.suffix != ".json":
        raise ValueError(f"--out {path}: give a .json name (--gpu reads a profile path by its "
                         f".json suffix), e.g. --out {path.with_suffix('.json')}")
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder: give a file name, e.g. --out "
                         f"{path / DEFAULT_OUT}")
    if not path.parent.is_dir():
        raise ValueError(f"--out {path}: the folder {path.parent} does not exist: create it "
                         "or choose another --out")
    if path.resolve().is_relative_to(PROFILE_DIR.resolve()):
        raise ValueError(f"--out {path} is in the profiles that ship with distllm "
                         f"({PROFILE_DIR}): choose a path outside it, e.g. --out {DEFAULT_OUT}")
    if not os.access(path.parent, os.W_OK | os.X_OK):  # before a minute of measuring
        raise ValueError(f"--out {path}: the folder {path.parent} is not writable here: "
                         f"choose another --out")
    return path


def write_profile(prof: Profile, path: Path) -> None:
    """Write ``prof`` to ``path`` whole or not at all (an interrupted write leaves any earlier
    file whole: :func:`distllm.files.write_text_atomic`)."""
    write_text_atomic(path, json.dumps(prof.to_json(), indent=1) + "\n")


def calibrate_cli(args: argparse.Namespace) -> int:
    """``distllm plan --calibrate``: ``--gpus`` is the rank count (default
    :data:`CALIBRATE_RANKS`), written as the profile's ``gpus_per_node``; ``--out`` the
    profile file (:func:`output_path`)."""
    ranks = CALIBRATE_RANKS if args.gpus is None else args.gpus
    if ranks < 1:
        raise ValueError(f"--gpus={ranks}: give --calibrate a positive rank count "
                         f"(default {CALIBRATE_RANKS})")
    from distllm.train.launch import cores

    if ranks > 4 * cores():  # (as distllm train --nproc: --gpus is a cluster's count elsewhere)
        raise ValueError(f"--gpus={ranks}: --calibrate runs that many ranks on this machine, "
                         f"which has {cores()} cores; choose 1..{4 * cores()} (default "
                         f"{CALIBRATE_RANKS})")
    out = output_path(args.out)
    if args.net is None:
        args.net = DEFAULT_NET
    if args.net:  # before anything is measured
        from distllm.testing.netem import parse_rate

        try:
            parse_rate(args.net)
        except ValueError as exc:  # (its message may name the flag already)
            why = str(exc)
            raise ValueError(why if why.startswith("--net") else f"--net {args.net!r}: {why}"
                             ) from None
    prof = calibrate(args.net or None, ranks=ranks)
    try:
        write_profile(prof, out)
    except OSError as exc:  # (the folder changed while measuring: full, or made read-only)
        raise ValueError(f"--out {out}: the profile could not be written ({exc.strerror or exc}):"
                         f" choose another --out and run again") from None
    p = prof
    print(
        f"wrote {out}: float32 {p.peak_flops['float32'] / 1e9:.1f} GFLOP/s "
        f"(model-shape efficiency {p.matmul_efficiency:.2f}), memory "
        f"{p.memory_bandwidth / 1e9:.1f} GB/s, op {p.op_overhead_s * 1e6:.1f} us, loopback "
        f"{p.links['intra'].bandwidth / 1e9:.2f} GB/s + {p.links['intra'].latency * 1e6:.0f} us, "
        f"inter {p.links['inter'].bandwidth / 1e9:.3f} GB/s + "
        f"{p.links['inter'].latency * 1e6:.0f} us"
    )
    print(f"plan with it: distllm plan --gpu {shlex.quote(str(out))} --gpus {ranks} "
          "--model MODEL")
    return 0
