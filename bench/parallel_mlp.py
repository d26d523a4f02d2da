"""Benchmark: the tensor-parallel MLP, fused against unfused against torch's own.

Suite ``parallel_mlp``: ``fc2(gelu(fc1(x)))`` for ``M`` tokens (``x`` of shape
``(1, M, H)``), hidden ``H``, ffn ``F`` (``--shapes "M,H,F"``), at tp2 on 2 gloo ranks and at
tp1 on one, forward alone (no autograd) and forward + backward. Variants, interleaved in one
run (timer: the slowest rank's step):

* ``fused``: ``ParallelMLP(backend=<the device's fused backend>)`` (CPU: ``cpu``; CUDA:
  ``cuda``, and ``fused-triton``): the column-parallel GEMM with bias and GeLU in its
  epilogue and the backward fused across the two GEMMs;
* ``unfused``: ``ParallelMLP(backend="reference")``: the same module and overlap engines with
  the GEMMs and the GeLU (and its derivative) as separate passes;
* ``auto``: ``ParallelMLP(backend="auto")`` (what it picked is the row's ``kernel``);
* ``peer``: torch's own: ``nn.Sequential(Linear, GELU, Linear)`` parallelised with DTensor
  ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``) at tp2, the plain
  ``nn.Sequential`` at tp1.

distllm's variants use ``overlap="auto"`` (the default). Each rank runs one thread (2 ranks
on 2 cores); ``speedup_vs_unfused`` is the unfused median over the variant's.
Run: ``distllm bench --suite parallel_mlp`` (``--quick`` for a small shape).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Case, Result, Setup, shapes
from distllm.bench.rows import row
from torch import nn

__all__ = ["SUITE", "cases", "setup", "rows"]

SUITE = "parallel_mlp"
PRESETS = {True: [(256, 128, 512)], False: [(2048, 1024, 4096)]}
PHASES = ("fwd", "fwd+bwd")
_FUSED = {"cpu": (("fused", "cpu"),), "cuda": (("fused", "cuda"), ("fused-triton", "triton"))}


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return [Case("-", skip="no CUDA device")]
    skip = "" if cfg.device == "cpu" else "tp2 runs on 2 gloo ranks on CPU; on a GPU, tp1 only"
    out = []
    for m, h, f in shapes(cfg, PRESETS[cfg.quick]):
        for tp in (2, 1):
            for phase in PHASES:
                out.append(Case(f"tp{tp} {phase} {m}x{h}x{f} {cfg.dtype}",
                                {"tp": tp, "phase": phase, "shape": (m, h, f)},
                                ranks=tp if cfg.device == "cpu" else 0,
                                skip=skip if tp > 1 else ""))
    return out


def _dtype(cfg: BenchConfig) -> torch.dtype:
    return getattr(torch, cfg.dtype)


def _peer(dense: nn.Sequential, tp: int) -> nn.Module:
    if tp == 1:
        return dense
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    return parallelize_module(dense, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def setup(cfg: BenchConfig, case: Case) -> Setup:
    from distllm import ParallelDims
    from distllm.nn import ParallelMLP
    from distllm.parallel.tensor import settle_overlap

    tp, phase, (m, h, f) = case.params["tp"], case.params["phase"], case.params["shape"]
    device, dtype = cfg.device, _dtype(cfg)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    dims = ParallelDims(tp=tp) if dist.is_initialized() or tp > 1 else ParallelDims(
        tp=1, backend="gloo")
    approx = "gelu_tanh" if device == "cuda" else "gelu"
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(h, f), nn.GELU(approximate="tanh" if device == "cuda"
                                                     else "none"), nn.Linear(f, h))
    dense = dense.to(device=device, dtype=dtype)

    class _Pair(nn.Module):  # fc1 / fc2 names for ParallelMLP.from_dense
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.activation = dense[0], dense[2], approx

    mlps = {name: ParallelMLP.from_dense(_Pair(), dims, backend=be)
            for name, be in (*_FUSED[device], ("unfused", "reference"), ("auto", "auto"))}
    peer = _peer(dense, tp)
    x = torch.randn(1, m, h, device=device, dtype=dtype)  # (1, M, H): all M tokens
    g = torch.randn(1, m, h, device=device, dtype=dtype)
    xg = x.clone().requires_grad_()
    unavailable = {}

    def call(mod: nn.Module):
        params = list(mod.parameters())

        def fwd():
            with torch.no_grad():
                return mod(x)

        def fwd_bwd():
            for p in params:
                p.grad = None
            xg.grad = None
            mod(xg).backward(g)

        return fwd if phase == "fwd" else fwd_bwd

    variants = {}
    for name, mod in (*mlps.items(), ("peer", peer)):
        try:
            call(mod)()  # a backend that cannot serve this device says so here
            variants[name] = call(mod)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            unavailable[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    for name, mod in mlps.items():  # overlap="auto"'s trial in the step, before the timing
        if name in variants:
            settle_overlap(variants[name], mod)
    sync = torch.cuda.synchronize if device == "cuda" else None
    from distllm.diagnostics.timing import wall_timer

    reps = cfg.reps or (5 if cfg.quick else 9)
    return Setup(variants, unavailable, warmup=1, reps=reps, timer=wall_timer(sync),
                 finish=lambda stats: {
                     "kernels": {n: mlps[n].overlap_stats["fc1"].kernel for n in mlps},
                     "tokens": x.shape[:-1].numel()},  # the tokens each call ran
                 close=lambda: torch.set_num_threads(threads))


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    tp, phase, (m, h, f) = case.params["tp"], case.params["phase"], case.params["shape"]
    st, base = result.stats, result.stats.get("unfused")
    info = result.info[0]
    kernels, tokens = info["kernels"], info["tokens"]  # tokens: what each call ran (M)
    flops = 2 * 2 * tokens * h * f / tp * (1 if phase == "fwd" else 3)  # per rank
    common = dict(device=cfg.device, dtype=cfg.dtype, shape=f"{m}x{h}x{f}", tp=tp, phase=phase,
                  net=result.net, threads_per_rank=1 if cfg.device == "cpu" else None,
                  tokens=tokens)
    out = []
    for name, s in st.items():
        sp = base.median_ms / s.median_ms if base else None
        out.append(row(SUITE, case.label, name, s, flops=flops, speedup_vs_unfused=sp,
                       kernel=kernels.get(name, "torch"), **common))
    for name, why in result.unavailable.items():
        out.append(row(SUITE, case.label, name, status="unavailable", reason=why, **common))
    return out
