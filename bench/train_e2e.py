"""End-to-end training throughput: distllm against PyTorch's own building blocks.

Suite ``train_e2e``: tokens/s of one full training step (forward, backward, gradient sync,
AdamW) of the same GPT (the ``tiny`` preset's shape) on 2 gloo ranks, at three layouts:

* ``tp2``: distllm's TP modules (overlapped row-parallel all-reduce) against a dense GPT
  parallelised with DTensor ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``);
* ``dp2.zero2``: distllm ``ZeroOptimizer(stage=2)`` against torch ``DistributedDataParallel``
  and FSDP2 ``fully_shard(reshard_after_forward=False)`` (ZeRO-2-like);
* ``pp2.1f1b``: distllm's pipeline executor against ``torch.distributed.pipelining``
  (``PipelineStage`` + ``Schedule1F1B``), same micro-batches.

Each layout's variants are interleaved in one run (timer: the slowest rank's step), on
loopback and, with ``cfg.net``, on the emulated network (:mod:`distllm.bench.netem`).
``vs_torch`` is the torch variant's best median over distllm's (>= 1.0: distllm is faster).

Suite ``train_overhead``: the fixed per-step overhead of the ``tiny`` model at tp1.pp1.dp1,
measured with ``torch.profiler``: step wall time minus the time spent inside operators
(aten, c10d, distllm custom ops; self times, so nothing is counted twice). Target <= 5%.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distllm.bench.harness import BenchConfig, interleaved, max_over_ranks_timer, row
from torch import nn

__all__ = ["run"]

SUITE, SUITE_OVH = "train_e2e", "train_overhead"
LAYOUTS = ("tp2", "dp2.zero2", "pp2.1f1b")
# (batch, seq, micro-batches) per mode; the model is the tiny preset (4 x h128, vocab 256)
_SHAPES = {True: (8, 64, 2), False: (16, 128, 4)}


# --- a dense GPT of the same shape from torch blocks -------------------------------------
class _Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)  # local heads under TP
        q, k, v = (t.reshape(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate="tanh"))


class _Embed(nn.Module):
    def __init__(self, vocab: int, h: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Parameter(torch.zeros(seq, h))

    def forward(self, t):
        return self.wte(t) + self.wpe[: t.shape[1]]


class _Head(nn.Module):
    def __init__(self, vocab: int, h: int):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def _dense_layers(cfg) -> list[nn.Module]:
    torch.manual_seed(0)
    return ([_Embed(cfg.vocab_size, cfg.hidden_size, cfg.max_seq_len)]
            + [_Block(cfg.hidden_size, cfg.n_heads, cfg.ffn_hidden_size)
               for _ in range(cfg.n_layers)] + [_Head(cfg.vocab_size, cfg.hidden_size)])


def _ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


# --- variants: each returns a step function ----------------------------------------------
def _distllm(layout: str, cfg, batch, seq, m, dims):
    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine

    kw = {"tp2": dict(tp=2), "dp2.zero2": dict(dp=2, zero=2),
          "pp2.1f1b": dict(pp=2, schedule="1f1b", micro_batches=m)}[layout]
    tc = TrainConfig(model="tiny", parallel=ParallelConfig(**kw), global_batch=batch,
                     seq_len=seq, steps=10, progress=False)
    eng = Engine(tc, cfg, dims)
    rows = batch // dims.dp
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)

    def step():
        eng.train_step(x, x)
        eng.step(1.0)

    return step


def _torch_tp(cfg, batch, seq, dims):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(*_dense_layers(cfg))
    for blk in list(model)[1:-1]:
        parallelize_module(blk, mesh, {"qkv": ColwiseParallel(), "o": RowwiseParallel(),
                                       "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = _adamw(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        _ce(model(x), x).backward()
        _clip_tp(list(model.parameters()), 1.0)
        opt.step()

    return step


@torch.no_grad()
def _clip_tp(params, max_norm: float) -> None:
    """Global-norm clipping over DTensor (sharded) and plain (replicated) gradients: one
    all-reduce of the sharded squares (``clip_grad_norm_`` refuses the mix)."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = torch.zeros((), dtype=torch.float64)
    rep = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local().double().square().sum()
            if any(isinstance(pl, Shard) for pl in g.placements):
                sharded += local
            else:
                rep += local
        else:
            rep += g.double().square().sum()
    dist.all_reduce(sharded)
    coef = max_norm / (float(sharded + rep) ** 0.5 + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def _torch_dp(kind: str, cfg, batch, seq, dims):
    model = nn.Sequential(*_dense_layers(cfg))
    if kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = _adamw(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch // 2, seq),
                      generator=torch.Generator().manual_seed(1 + dims.rank))

    def step():
        opt.zero_grad()
        _ce(wrapped(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def _torch_pp(cfg, batch, seq, m, dims):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layers = _dense_layers(cfg)
    half = (len(layers) + 1) // 2
    mine = nn.Sequential(*(layers[:half] if dims.pp_rank == 0 else layers[half:]))
    stage = PipelineStage(mine, dims.pp_rank, 2, torch.device("cpu"), group=dims.pp_group)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=_ce)
    opt = _adamw(mine.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        if dims.pp_rank == 0:
            sched.step(x)
        else:
            sched.step(target=x, losses=[])
        torch.nn.utils.clip_grad_norm_(mine.parameters(), 1.0)
        opt.step()

    return step




def _rank(layout: str, quick: bool, reps: int) -> dict:
    from distllm import ParallelDims
    from distllm.models.gpt import GPTConfig

    torch.set_num_threads(1)
    batch, seq, m = _SHAPES[quick]
    cfg = GPTConfig.preset("tiny")
    kw = {"tp2": dict(tp=2), "dp2.zero2": dict(dp=2), "pp2.1f1b": dict(pp=2)}[layout]
    dims = ParallelDims(**kw)
    builders = {"distllm": lambda: _distllm(layout, cfg, batch, seq, m, dims)}
    if layout == "tp2":
        builders["torch_dtensor_tp"] = lambda: _torch_tp(cfg, batch, seq, dims)
    elif layout == "dp2.zero2":
        builders["torch_ddp"] = lambda: _torch_dp("ddp", cfg, batch, seq, dims)
        builders["torch_fsdp2_zero2"] = lambda: _torch_dp("fsdp2", cfg, batch, seq, dims)
    else:
        builders["torch_pipelining_1f1b"] = lambda: _torch_pp(cfg, batch, seq, m, dims)
    variants, missing = {}, {}
    for name, build in builders.items():
        try:
            variants[name] = build()
        except Exception as e:  # noqa: BLE001 - a variant that cannot run here is a row
            missing[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    stats = interleaved(variants, warmup=2, reps=reps, timer=max_over_ranks_timer(),
                        before_each=dist.barrier)
    return {"stats": stats, "missing": missing, "tokens": batch * seq}


def _layout_rows(layout: str, res: dict, label: str, reason: str) -> list[dict]:
    stats, tokens = res["stats"], res["tokens"]
    ours = stats.get("distllm")
    torch_best = min((s.median_ms for n, s in stats.items() if n != "distllm"), default=None)
    case = f"{label} {layout} tiny b{_shape_of(tokens)}"
    rows = []
    for name, st in stats.items():
        kw = dict(net=label, tokens_per_s=tokens / (st.median_ms * 1e-3), device="cpu",
                  dtype="float32", role="fused" if name == "distllm" else "peer")
        if name == "distllm" and torch_best is not None:
            kw["vs_torch"] = torch_best / st.median_ms
        if reason:
            kw["note"] = reason
        rows.append(row(SUITE, case, name, st, **kw))
    for name, why in res["missing"].items():
        rows.append(row(SUITE, case, name, status="unavailable", reason=why, net=label))
    if ours is None:
        rows.append(row(SUITE, case, "distllm", status="unavailable", reason="did not build"))
    return rows


def _shape_of(tokens: int) -> str:
    return f"{tokens} tokens/step"


def _overhead_rank(quick: bool, reps: int) -> dict:
    """Profile tiny at tp1.pp1.dp1: the step's wall time (unprofiled steps, interleaved with
    the profiled ones, since the profiler slows the host) against the time spent inside
    operators (profiled steps)."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from distllm import ParallelDims
    from distllm.models.gpt import GPTConfig

    torch.set_num_threads(1)
    batch, seq, _ = _SHAPES[quick]
    step = _distllm_single(GPTConfig.preset("tiny"), batch, seq, ParallelDims())
    for _ in range(3):
        step()
    walls, ops = [], []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ops.append(_op_ms(prof))
    wall, op = statistics.median(walls), statistics.median(ops)
    return {"wall_ms": wall, "wall_p10": _q(walls, 0.1), "wall_p90": _q(walls, 0.9),
            "op_ms": op, "overhead_frac": max(0.0, wall - op) / wall}


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _distllm_single(cfg, batch, seq, dims):
    from distllm.train.config import TrainConfig
    from distllm.train.engine import Engine

    tc = TrainConfig(model="tiny", global_batch=batch, seq_len=seq, steps=10, progress=False)
    eng = Engine(tc, cfg, dims)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        eng.train_step(x, x)
        eng.step(1.0)

    return step


def _op_ms(prof) -> float:
    """Self time (ms) of operator events: aten, c10d/gloo collectives, custom ops."""
    prefixes = ("aten::", "c10d::", "gloo:", "distllm::", "record_param_comms")
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                   if e.key.startswith(prefixes))
    return total_us / 1e3


def run(cfg: BenchConfig) -> list[dict]:
    from distllm.bench.netem import link

    from distllm.testing import run_distributed

    if cfg.device != "cpu":
        return [row(SUITE, "-", "-", status="unavailable",
                    reason="the CPU suite (gloo ranks)")]
    reps = cfg.reps or (3 if cfg.quick else 10)
    rows: list[dict] = []
    nets = [None] + ([cfg.net] if cfg.net else [])
    for rate in nets:
        with link(rate) as lk:
            label, reason = lk.label, lk.reason
            for layout in LAYOUTS:
                res = run_distributed(_rank, 2, layout, cfg.quick, reps, timeout=1800,
                                      setup=lk.setup, env=lk.env)[0]
                rows.extend(_layout_rows(layout, res, label, reason))
    ovh = run_distributed(_overhead_rank, 1, cfg.quick, reps, timeout=600)[0]
    rows.append(row(SUITE_OVH, "tiny tp1.pp1.dp1", "distllm", None, ms=ovh["wall_ms"],
                    ms_p10=ovh["wall_p10"], ms_p90=ovh["wall_p90"], op_ms=ovh["op_ms"],
                    overhead_frac=ovh["overhead_frac"],
                    target="<= 0.05", met=ovh["overhead_frac"] <= 0.05, device="cpu",
                    dtype="float32"))
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    from distllm.bench.harness import markdown_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--net", default=None, help="emulated link rate, e.g. 2gbit")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args(argv)
    rows = run(BenchConfig(quick=a.quick, net=a.net, reps=a.reps))
    print(markdown_table(rows, columns=["suite", "case", "variant", "ms", "ms_p10", "ms_p90",
                                        "status", "reason", "extra"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
