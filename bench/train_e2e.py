"""End-to-end training throughput: distllm against PyTorch's own building blocks.

Suite ``train_e2e``: tokens/s of one full training step (forward, backward, gradient sync,
global-norm clipping, AdamW) of the same GPT on 2 gloo ranks, at four layouts:

* ``tp2``: distllm's TP modules (overlapped row-parallel all-reduce) against a dense GPT
  parallelised with DTensor ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``);
* ``dp2``: distllm's data parallelism as ``distllm train --dp 2`` runs it (ZeRO stage 0:
  bucketed all-reduce, ``--overlap-grad-reduce auto``, whose trial runs before the timing
  and whose decision the row carries as ``extra.grad_reduce``) against torch
  ``DistributedDataParallel``;
* ``dp2.zero2``: distllm ``ZeroOptimizer(stage=2)`` against torch ``DistributedDataParallel``
  and FSDP2 ``fully_shard(reshard_after_forward=False)`` (ZeRO-2-like);
* ``pp2.1f1b``: distllm's pipeline executor against ``torch.distributed.pipelining``
  (``PipelineStage`` + ``Schedule1F1B``), same micro-batches.

Model sizes: ``--shapes "L,H,B,S[,M];..."`` (blocks, hidden size, global batch, sequence
length, micro-batches; heads of 64 channels, or the ``tiny`` preset's 4 at hidden 128; MLP
4H; vocabulary 256). Every layout must run a shape on 2 ranks (an even number of heads,
``B`` even, ``M >= 2`` dividing ``B``): else ``--shapes`` is refused, naming the value to
change (:func:`check_shapes`). Presets: the ``tiny`` preset and 6 blocks at GPT-2 small's
width with a short sequence (a step of about a second on 2 CPU ranks); ``--quick``: tiny
alone. Or
``--model NAME[,NAME...]`` (``cfg.extra["model"]``): GPT presets, each one size with the
preset's blocks and hidden size at its size class's batch, sequence and micro-batches
(:func:`model_shapes`).

distllm's step is ``Engine.forward_backward`` then ``Engine.update`` (one host read per
step: loss, norm and inf/NaN flag together). Each layout's variants are interleaved in one
run (timer: the slowest rank's step), on loopback and, with ``cfg.net``, on the emulated
network (:mod:`distllm.testing.netem`; where it cannot be built, one ``unavailable`` row
for the rate, or in a quick run the rows on loopback with the reason). A step that leaves
work in flight for the next one (ZeRO-2's parameter all-gathers, which the next forward
waits for layer by layer) is timed as the middle of three
(:class:`distllm.bench.harness.LoopStep`): as in a training loop, it waits for the previous
step's gathers and its own overlap the step after, instead of a barrier absorbing them
untimed. ``vs_torch`` is the torch variant's best median over
distllm's (>= 1.0: distllm is faster).

After the timing, one step of each variant is profiled on every rank
(:func:`distllm.bench.step_breakdown.breakdown`: operators, collectives and their bytes,
copies, allocations, host syncs, time outside operators), then run three times unprofiled
to split its CPU between the step's own thread and the others, gloo's communication threads
(:func:`distllm.bench.step_breakdown.cpu_split`, under ``cpu``); rank 0's goes into each
row's ``extra.breakdown`` and, with ``--out``, into ``train_e2e_breakdown.json`` next to the
results, with distllm's counts against its best peer's (``extra.vs_peer``).

Suite ``train_overhead``: the fixed per-step overhead of the ``tiny`` model at tp1.pp1.dp1,
measured with ``torch.profiler``: step wall time minus the time spent inside operators
(aten, c10d, distllm custom ops; self times, so nothing is counted twice), the plain and
the profiled steps interleaved (the profiler slows the host). Target <= 5%.
``extra.overhead_band``: its p10..p90 taken round by round (each plain step against the
profiled step of its round).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Case, LoopStep, Result, Setup, build_and_step, shapes
from distllm.bench.rows import judge_target, row, write_text_atomic
from distllm.bench.step_breakdown import OP_PREFIXES, breakdown, compare_breakdowns, cpu_split
from distllm.bench.train_e2e_variants import builders, distllm_single, drain

from distllm.diagnostics.timing import Stats, paired_band

__all__ = ["SUITE", "cases", "setup", "rows", "model_of", "model_names", "model_shapes",
           "check_shapes", "BREAKDOWN_FILE"]

SUITE, SUITE_OVH = "train_e2e", "train_overhead"
LAYOUTS = ("tp2", "dp2", "dp2.zero2", "pp2.1f1b")
# (blocks, hidden, global batch, seq, micro-batches) per mode
_PRESETS = {True: [(4, 128, 8, 64, 2)], False: [(4, 128, 16, 128, 4), (6, 768, 8, 64, 4)]}
BREAKDOWN_FILE = "train_e2e_breakdown.json"


def model_of(shape: tuple[int, ...]):
    """``(GPTConfig, name)`` of a shape ``(blocks, hidden, batch, seq[, micro-batches])``:
    the ``tiny`` preset at (4, 128), else heads of 64 channels and an MLP of 4H."""
    from distllm.models.config import GPTConfig

    layers, hidden, _, seq = shape[:4]
    if (layers, hidden) == (4, 128) and seq <= 128:
        return GPTConfig.preset("tiny"), "tiny"
    name = f"{layers}x{hidden}"
    return GPTConfig(n_layers=layers, hidden_size=hidden, n_heads=max(1, hidden // 64),
                     ffn_hidden_size=4 * hidden, max_seq_len=max(seq, 128), name=name), name


def model_names(spec: str | Sequence[str]) -> list[str]:
    """The GPT preset names of ``--model`` (``"tiny,gpt2-small"`` or a list), checked."""
    from distllm.models.config import GPTConfig

    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    valid = GPTConfig.presets()
    bad = [n for n in names if n not in valid]
    if bad or not names:
        what = f"unknown GPT preset(s) {', '.join(bad)}" if bad else "no GPT preset named"
        raise ValueError(f"--model {spec if isinstance(spec, str) else ','.join(spec)!r}: "
                         f"{what}; choose from {', '.join(valid)} (comma-separated)")
    return names


def model_shapes(spec: str | Sequence[str], quick: bool = False) -> list[tuple[int, ...]]:
    """One size per GPT preset of ``--model``: the preset's blocks and hidden size at the
    default batch, sequence and micro-batches of its size class (the ``tiny`` row up to
    hidden 128, else the 6x768 row)."""
    from distllm.models.config import GPTConfig

    small, wide = _PRESETS[quick][0], _PRESETS[False][-1]
    out = []
    for name in model_names(spec):
        g = GPTConfig.preset(name)
        rest = (small if g.hidden_size <= small[1] else wide)[2:]  # batch, seq, micro-batches
        out.append((g.n_layers, g.hidden_size, *rest))
    return out


def _layout_problem(given: tuple[int, ...]) -> str:
    """What keeps shape ``given`` (``L,H,B,S[,M]``) from running every layout on 2 ranks,
    naming the value to change, or ""."""
    shape = tuple(given) if len(given) == 5 else (*given, 4)
    _, hidden, batch, _, micro = shape
    where = f"(in {','.join(map(str, given))})"
    try:
        heads = model_of(shape)[0].n_heads
    except ValueError:  # its heads (one per 64 channels) do not divide the hidden size
        heads = max(1, hidden // 64)
        return (f"model at H={hidden} {where} has {heads} heads (one per 64 channels), which "
                f"do not divide H; choose H a multiple of 128")
    if heads % 2 or hidden % 2:
        return (f"tp2 splits the model's heads over its 2 ranks, and H={hidden} {where} gives "
                f"{heads} head{'s' if heads > 1 else ''} (one per 64 channels); choose H a "
                f"multiple of 128")
    if batch % 2:
        return (f"dp2 and dp2.zero2 split the global batch over their 2 ranks, and B={batch} "
                f"{where} is odd; choose B a multiple of 2")
    if micro < 2:
        return (f"pp2.1f1b needs at least 2 micro-batches (one per stage), not M={micro} "
                f"{where}; choose M >= 2")
    if batch % micro:
        return (f"pp2.1f1b splits the global batch into M micro-batches, and M={micro} does "
                f"not divide B={batch} {where}; choose B a multiple of M")
    return ""


def check_shapes(given: list[tuple[int, ...]], spec: str) -> None:
    """ValueError naming ``--shapes`` (``spec``) and the value to change where a shape cannot
    run one of :data:`LAYOUTS` on 2 ranks: heads (and hidden size) that tp2 cannot split,
    a global batch that dp2 cannot, fewer than 2 micro-batches or a batch they do not divide
    for pp2.1f1b. (A variant would otherwise fail on one rank and wait on the other, or
    time fewer tokens than its row counts.)"""
    for s in given:
        why = _layout_problem(s)
        if why:
            raise ValueError(f"--shapes {spec!r}: train_e2e's {why}")


def _shapes(cfg: BenchConfig) -> list[tuple[int, ...]]:
    if cfg.extra.get("model"):
        if cfg.shapes:
            raise ValueError("--model and --shapes both set train_e2e's model sizes: give one")
        return model_shapes(cfg.extra["model"], cfg.quick)
    given = shapes(cfg, _PRESETS[cfg.quick])
    for s in given:
        if len(s) not in (4, 5):
            raise ValueError(f"--shapes {s}: train_e2e takes 'L,H,B,S[,M]' (blocks, hidden, "
                             "global batch, sequence length, micro-batches), e.g. '6,768,8,64'")
    if cfg.shapes:
        check_shapes(given, cfg.shapes)
    return [tuple(s) if len(s) == 5 else (*s, 4) for s in given]


def cases(cfg: BenchConfig) -> list[Case]:
    """Each layout at each model size on 2 ranks (loopback and ``cfg.net``), then the
    overhead on 1 rank."""
    if cfg.device != "cpu":
        return [Case("-", skip="the CPU suite (gloo ranks)")]
    out = []
    for shape in _shapes(cfg):
        name = model_of(shape)[1]
        out += [Case(f"{layout} {name}", {"layout": layout, "shape": shape}, ranks=2,
                     networks=True) for layout in LAYOUTS]
    return out + [Case("tiny tp1.pp1.dp1", {"overhead": True}, ranks=1, suite=SUITE_OVH,
                       timeout=600)]


def setup(cfg: BenchConfig, case: Case) -> Setup:
    """distllm's step and its torch peers at one layout and size (a variant that cannot be
    built here, or whose first step fails, is listed with its error), each profiled once
    after the timing; or the overhead case's plain and profiled steps."""
    from distllm import ParallelDims
    from distllm.parallel.tensor import settle_overlap

    torch.set_num_threads(1)
    reps = cfg.reps or (3 if cfg.quick else 10)
    if case.params.get("overhead"):
        return _overhead_setup(cfg, reps)
    layout, shape = case.params["layout"], tuple(case.params["shape"])
    gcfg, name = model_of(shape)
    kw = {"tp2": dict(tp=2), "dp2": dict(dp=2), "dp2.zero2": dict(dp=2),
          "pp2.1f1b": dict(pp=2)}[layout]
    dims = ParallelDims(**kw)
    variants, missing = {}, {}
    for vname, build in builders(layout, gcfg, shape, dims).items():
        step, why = build_and_step(build, _step_and_drain)
        if why is None:
            variants[vname] = step
        else:
            missing[vname] = why

    if "distllm" in variants:  # the "auto" trials in the step run before the timing
        ours = variants["distllm"]
        settle_overlap(ours, ours.engine.chunks)  # the row-parallel schedules
        while ours.engine.reduction_tuning():  # the gradient reduction's (as many steps
            ours()  # on every rank)
        if (d := drain(ours)) is not None:
            d()
    steps = dict(variants)  # a step that leaves work in flight is timed within a loop
    variants = {n: f if (d := drain(f)) is None else LoopStep(f, d) for n, f in steps.items()}

    def finish(stats: dict[str, Stats]) -> dict:
        prof = {n: breakdown(f, before=dist.barrier, drain=drain(f)) for n, f in steps.items()}
        for n, f in steps.items():  # the same step unprofiled: the CPU of each thread
            prof[n]["cpu"] = cpu_split(f, before=dist.barrier, drain=drain(f))
        dist.barrier()
        return {"tokens": shape[2] * shape[3], "model": name, "breakdown": prof,
                "grad_reduce": (steps["distllm"].engine.reduction_reason()
                                if "distllm" in steps else None)}

    return Setup(variants, missing, warmup=2, reps=reps, finish=finish)


def _step_and_drain(step) -> None:
    """One step, and the work it leaves in flight."""
    step()
    if (d := drain(step)) is not None:
        d()


def _layout_rows(layout: str, res: dict, label: str, reason: str) -> list[dict]:
    stats, tokens, prof = res["stats"], res["tokens"], res.get("breakdown") or {}
    ours = stats.get("distllm")
    peers = {n: s for n, s in stats.items() if n != "distllm"}
    best = min(peers, key=lambda n: peers[n].median_ms) if peers else None
    case = f"{label} {layout} {res['model']} b{tokens} tokens/step"
    rows = []
    for name, st in stats.items():
        kw = dict(net=label, tokens_per_s=tokens / (st.median_ms * 1e-3), device="cpu",
                  dtype="float32", role="fused" if name == "distllm" else "peer",
                  model=res["model"], layout=layout)
        if name in prof:
            kw["breakdown"] = {k: v for k, v in prof[name].items() if k != "top"}
        if name == "distllm" and res.get("grad_reduce"):
            kw["grad_reduce"] = res["grad_reduce"]  # how its gradient reduction ran, and why
        if name == "distllm" and best is not None:
            kw["vs_torch"] = peers[best].median_ms / st.median_ms
            kw["best_peer"] = best
            if name in prof and best in prof:
                kw["vs_peer"] = compare_breakdowns(prof[name], prof[best])
        if reason:
            kw["note"] = reason
        rows.append(row(SUITE, case, name, st, **kw))
    for name, why in res["missing"].items():
        rows.append(row(SUITE, case, name, status="unavailable", reason=why, net=label))
    if ours is None and "distllm" not in res["missing"]:  # else its row says why above
        rows.append(row(SUITE, case, "distllm", status="unavailable", reason="did not build",
                        net=label))
    return rows


def write_breakdown(out: Path, case: str, prof: dict[str, dict]) -> Path:
    """Add one case's breakdowns (variant -> counts, rank 0) to ``out/BREAKDOWN_FILE``."""
    p = Path(out) / BREAKDOWN_FILE
    data = json.loads(p.read_text()) if p.exists() else {}
    data[case] = prof
    # whole or not at all: a run killed while writing leaves the earlier cases readable
    return write_text_atomic(p, json.dumps(data, indent=1))


def _overhead_setup(cfg: BenchConfig, reps: int) -> Setup:
    """tiny at tp1.pp1.dp1: ``wall`` is one plain step; ``profiled`` the same step under
    ``torch.profiler``, recording the time spent inside operators."""
    from torch.profiler import ProfilerActivity

    from distllm import ParallelDims
    from distllm.diagnostics.profiler import profile
    from distllm.models.config import GPTConfig

    _, _, batch, seq, _ = _PRESETS[cfg.quick][0]
    step = distllm_single(GPTConfig.preset("tiny"), batch, seq, ParallelDims())
    ops: list[float] = []

    def profiled() -> None:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ops.append(_op_ms(prof))

    def finish(stats: dict[str, Stats]) -> dict:
        rounds = ops[-stats["profiled"].n:]  # the timed calls, in the order they ran
        return {"op_ms": statistics.median(rounds), "op_ms_rounds": rounds}

    # (at least 5 by default, the paired band's minimum; --reps as given)
    return Setup({"wall": step, "profiled": profiled}, warmup=3,
                 reps=reps if cfg.reps else max(reps, 5), finish=finish)


def _op_ms(prof) -> float:
    """Self time (ms) of operator events (:data:`~distllm.bench.step_breakdown.OP_PREFIXES`:
    aten, the oneDNN kernels, collectives, distllm's custom ops) and of gloo's transfers."""
    prefixes = (*OP_PREFIXES, "gloo:", "record_param_comms")
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                   if e.key.startswith(prefixes))
    return total_us / 1e3


def _overhead(wall_ms: float, op_ms: float) -> float:
    """The share of a step's wall time spent outside operators (below 0 where the profiled
    step's operators took longer than the plain step: a measurement error, not a share)."""
    return (wall_ms - op_ms) / wall_ms


def _overhead_row(cfg: BenchConfig, case: Case, result: Result) -> dict:
    wall, op = result.stats["wall"], result.info[0]["op_ms"]
    frac = _overhead(wall.median_ms, op)
    # round by round: each plain step against the profiled step of its round
    band = paired_band(_overhead, wall.samples_ms, result.info[0].get("op_ms_rounds") or [])
    why = {}
    if frac < 0:  # the profiler slowed the operators past a plain step: nothing to read
        why = {"overhead_unresolved": f"the profiled step's operators took {op:.3g} ms, more "
                                      f"than a plain step's {wall.median_ms:.3g} ms"}
        frac = None
    _, _, batch, seq, _ = _PRESETS[cfg.quick][0]
    # met: the median's; target_status: the whole band's (judge_target)
    judged = {} if frac is None else judge_target((frac, band, 0.05))
    return row(SUITE_OVH, case.label, "distllm", wall, op_ms=op, overhead_frac=frac,
               overhead_band=band, target="<= 0.05", met=None if frac is None else frac <= 0.05,
               device="cpu", dtype="float32", shape=f"batch {batch}x{seq}", **why, **judged)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    if case.params.get("overhead"):
        return [_overhead_row(cfg, case, result)]
    info = result.info[0]
    res = {"stats": result.stats, "missing": result.unavailable, **info}
    out = _layout_rows(case.params["layout"], res, result.net, result.net_reason)
    if cfg.out is not None and info.get("breakdown"):
        write_breakdown(cfg.out, out[0]["case"], info["breakdown"])
    return out
