"""Check the planner against ``distllm train`` on this machine: predicted vs measured step
time and peak memory of the ``tiny`` model on 4 gloo ranks, on loopback and on the emulated
network; and whether the planner's first choice is the fastest measured layout.

Each layout runs ``distllm.train``'s trainer (the code behind ``distllm train``) in 4 ranks
and its step times are read back from the run's ``metrics.jsonl`` (median after warm-up).
The same ranks then build the training engine again and measure memory: model states from
the tensors held (``distllm.parallel.data.memory.memory_report``), plus the peak of
allocations during one step (the allocator's bytes in use after each operator; see
:func:`_peak_during`). Each row keeps the machine's load as its runs started. Layouts run in rounds
(A B C, C B A, ...) so that drift of the shared machine hits them alike.

One case per network (loopback, and ``--net``). The predictions use ``cfg.extra["profile"]``
(a profile name or file), else a calibration of this machine (``distllm plan --calibrate``;
a ``--quick`` run uses the packaged ``cpu`` profile and measures :data:`QUICK_LAYOUTS`).
``cfg.extra`` may also set ``rounds``, ``steps`` (at least :data:`WARMUP_STEPS` +
:data:`MIN_TIMED`) and ``layouts`` (tuples as in :data:`LAYOUTS`; ``[]``: only the pick).
The planner's own pick is always measured too. A layout whose training run fails or times
out is one ``unavailable`` row with why; the other layouts are kept.
:func:`repredict` recomputes the predictions of an earlier run's ``results.json`` with the
current model.

    distllm bench --suite plan_validation --net 1gbit
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from distllm.bench.harness import BenchConfig, Case, Result, Setup
from distllm.bench.rows import row, write_text_atomic

from distllm.diagnostics.timing import stats_of

SUITE = "plan_validation"
CPU_STEPS = 3  # steps whose CPU time each rank measures after the memory probe
WARMUP_STEPS = 2  # the first steps of each run, not among the samples (:func:`_measure`)
MIN_TIMED = 3  # steps each run times at least, after its warm-up
BATCH, SEQ, RANKS = 16, 128, 4
# (tp, pp, dp, zero, schedule, micro_batches, checkpointing)
LAYOUTS = [
    (1, 1, 4, 0, "none", 1, "none"),
    (1, 1, 4, 2, "none", 1, "none"),
    (1, 1, 4, 3, "none", 1, "none"),
    (2, 1, 2, 0, "none", 1, "none"),
    (4, 1, 1, 0, "none", 1, "none"),
    (1, 2, 2, 0, "1f1b", 4, "none"),
    (1, 4, 1, 0, "1f1b", 4, "none"),
    (2, 2, 1, 0, "gpipe", 2, "none"),
    (1, 1, 4, 0, "none", 2, "full"),
]
QUICK_LAYOUTS = [LAYOUTS[0], LAYOUTS[3], LAYOUTS[5]]


def _layout(t: tuple):
    from distllm.plan import Layout

    tp, pp, dp, zero, sch, m, ck = t
    return Layout(tp, pp, dp, zero, sch, m, ck, False, 1)


def _trial_steps(t: tuple) -> int:
    """Steps that the trials in the step take at layout ``t`` on CPU, run on top of the
    measured ones; both start at the first step and run side by side:
    ``overlap="auto"``'s under tensor parallelism (the first step measures, then the trial's
    calls of a shape, :func:`overlap_tuner.trial_calls`, one call a step per block of a stage
    and micro-batch), and ``--overlap-grad-reduce auto``'s with data parallelism at ZeRO
    stages 0-1 (:func:`reduction_trial.trial_cycles`, one a step)."""
    from distllm.models import GPTConfig
    from distllm.parallel.data import reduction_trial
    from distllm.parallel.tensor import overlap_tuner

    tp, pp, dp, zero, _, m, _ = t
    steps = 0
    if tp > 1:
        per_step = max(1, GPTConfig.preset("tiny").n_layers // pp) * m
        steps = 1 + math.ceil(overlap_tuner.trial_calls() / per_step)
    if dp > 1 and zero <= 1:
        steps = max(steps, reduction_trial.trial_cycles())
    return steps


def _train_cfg(lay, steps: int, out: str, data: str):
    from distllm.train.config import ParallelConfig, TrainConfig

    pc = ParallelConfig.from_layout(lay)
    return TrainConfig(
        model="tiny",
        parallel=pc,
        global_batch=BATCH,
        seq_len=SEQ,
        steps=steps,
        dtype="float32",
        out=out,
        data=data,
        save_final=False,
        eval_batches=0,
        progress=False,
        activation_checkpointing=lay.checkpointing,
    )


def _heap_bytes():
    """Bytes the C allocator holds for this process now (glibc ``mallinfo2``: the main
    arena's allocated chunks plus mmapped ones), or None where there is no glibc."""
    import ctypes
    import ctypes.util

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        fn = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _Mallinfo2

    def now() -> int:
        m = fn()
        return m.uordblks + m.hblkhd

    return now


def _peak_during(fn) -> tuple[int, str]:
    """Peak bytes in use above the starting point while ``fn`` runs, and how it was taken.

    Where glibc is there: the allocator's bytes in use, read after every operator (a
    dispatch mode sees forward, backward and the hooks' operators), so every free counts,
    wherever it happens (storage resizes of ZeRO-3, tensors dropped outside an operator).
    Elsewhere: the profiler's CPU memory events accumulated in time order, which miss such
    frees and so overstate the peak."""
    heap = _heap_bytes()
    if heap is not None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Sample(TorchDispatchMode):
            peak = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                self.peak = max(self.peak, heap())
                return out

        import gc

        import torch

        with _Sample():  # the mode's first use allocates for itself: not the step's
            torch.ones(2).add_(1)
        gc.collect()
        start = heap()
        mode = _Sample()
        mode.peak = start
        with mode:
            fn()
        return mode.peak - start, "allocator bytes in use after each operator (glibc mallinfo2)"
    from torch.profiler import ProfilerActivity

    from distllm.diagnostics.profiler import profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += ev.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak, "profiler memory events in time order (frees outside operators missed)"


def _rank_main(t: tuple, steps: int, out: str, data: str, probe: bool) -> dict | None:
    import gc

    from distllm import ParallelDims
    from distllm.models import GPTConfig
    from distllm.parallel.data.memory import memory_report
    from distllm.train.data import BatchLoader, load_corpus
    from distllm.train.engine import Engine
    from distllm.train.trainer import train

    lay = _layout(t)
    cfg = _train_cfg(lay, steps, out, data)
    dims = ParallelDims(tp=lay.tp, pp=lay.pp, dp=lay.dp)
    train(cfg, dims)  # step times land in out/metrics.jsonl
    if not probe:
        return None
    gc.collect()
    mcfg = GPTConfig.preset("tiny")
    loader = BatchLoader(
        load_corpus(None).train,
        seq_len=SEQ,
        global_batch=BATCH,
        dp=dims.dp,
        dp_rank=dims.dp_rank,
        seed=cfg.seed,
    )
    engine = Engine(cfg, mcfg, dims)

    def one_step():  # as the trainer steps: one host read (loss, norm, flag together)
        tok, tgt = loader.next()
        engine.update(1.0, loss=engine.forward_backward(tok, tgt))

    one_step()  # creates the optimizer state
    gc.collect()
    rep = (
        memory_report(engine.zero)
        if engine.zero is not None
        else memory_report(engine.ddp, engine.optimizer)
    )
    peak, how = _peak_during(one_step)
    # CPU seconds of this rank's step (its threads, gloo's included): other users' load
    # stretches the wall time of a step, not this
    cpu0 = time.process_time()
    for _ in range(CPU_STEPS):
        one_step()
    return {
        "cpu_s": (time.process_time() - cpu0) / CPU_STEPS,
        "how": how,
        "params": rep.params,
        "grads": rep.grads,
        "optimizer": rep.optimizer,
        "states": rep.total,
        "step_peak": peak,
        "total": rep.total + peak,
    }


def _corpus(folder: str) -> str:
    """A 2 MB slice of the default corpus (the standard library's sources) in one file, so
    that each run does not re-read the whole library."""
    from distllm.train.data import default_corpus_files

    path, size = Path(folder, "corpus.txt"), 0
    with path.open("wb") as f:
        for src in default_corpus_files():
            data = src.read_bytes()
            f.write(data + b"\n\n")
            size += len(data)
            if size > 2 << 20:
                break
    return str(path)


def _measure(t: tuple, steps: int, net, data: str, probe: bool) -> dict:
    from distllm.testing import run_distributed

    with tempfile.TemporaryDirectory(prefix="planval-") as out:
        kw = {"setup": net.setup, "env": net.env} if net is not None else {}
        per_rank = run_distributed(_rank_main, RANKS, t, steps, out, data, probe, timeout=600, **kw)
        lines = Path(out, "metrics.jsonl").read_text().splitlines()
    # the warm-up steps, and the steps of overlap="auto"'s trial in the step (rank 0's)
    rec = [json.loads(x) for x in lines][WARMUP_STEPS:]
    settled = [r["step_time_s"] for r in rec if not r.get("overlap_tuning")]
    times = (settled if len(settled) >= MIN_TIMED
             else [r["step_time_s"] for r in rec[-MIN_TIMED:]])
    worst = max(per_rank, key=lambda r: r["total"]) if probe else None
    if worst is not None:
        worst = dict(worst, ranks_cpu_s=sum(r["cpu_s"] for r in per_rank))
    return {"times": times, "mem": worst, "per_rank": per_rank,
            "tuning_steps": len(rec) - len(settled)}


def _predict(t: tuple, profile, gpn: int):
    from distllm.plan import CostModel, preset
    from distllm.plan.bubble import simulator_or_none

    shape = preset("tiny").with_(global_batch=BATCH, seq_len=SEQ)
    cm = CostModel(
        shape,
        profile,
        RANKS,
        gpn,
        dtype="float32",
        simulator=simulator_or_none(),
        ranks_per_host=RANKS,
    )
    return cm.evaluate(_layout(t))


def _planner_pick(profile, gpn: int, pins: dict | None = None):
    from distllm.plan import preset, search

    shape = preset("tiny").with_(global_batch=BATCH, seq_len=SEQ)
    res = search(shape, RANKS, gpn, profile, dtype="float32", pins=pins, ranks_per_host=RANKS)
    return res.best.layout


def _as_tuple(lay) -> tuple:
    return (lay.tp, lay.pp, lay.dp, lay.zero, lay.schedule, lay.micro_batches, lay.checkpointing)


@functools.cache
def _calibrated(net: str | None):
    from distllm.plan.calibrate import calibrate

    return calibrate(net, ranks=RANKS)


def _profile(cfg: BenchConfig):
    """The hardware profile of the predictions (see the module docstring)."""
    from distllm.plan import load_profile

    name = cfg.extra.get("profile") or ("cpu" if cfg.quick else None)
    return load_profile(name) if name else _calibrated(cfg.net)


def _steps(cfg: BenchConfig) -> int:
    """The measured steps of each training run (``cfg.extra["steps"]``), checked: the
    warm-up and at least :data:`MIN_TIMED` timed steps (ValueError naming the option)."""
    raw, least = cfg.extra.get("steps", 5 if cfg.quick else 8), WARMUP_STEPS + MIN_TIMED
    try:
        steps = int(raw)
    except (TypeError, ValueError):
        steps = None
    if steps is None or steps < least:
        raise ValueError(f"plan_validation: cfg.extra['steps'] = {raw!r}: each training run "
                         f"needs at least {least} steps ({WARMUP_STEPS} of warm-up, then "
                         f"{MIN_TIMED} timed); set cfg.extra['steps'] to {least} or more")
    return steps


def _failure(e: Exception) -> str:
    """Why a layout's training run failed, on one line: the message's first line and, where
    it carries a rank's traceback, the exception that ends it."""
    lines = [ln.strip() for ln in str(e).split("\n(ranks ")[0].splitlines() if ln.strip()]
    text = " ".join(dict.fromkeys(lines[:1] + lines[-1:]))  # the first line and the last
    return f"its training run failed: {type(e).__name__}: {text}"[:400]


def _write_profile(out: Path, profile) -> Path:
    """``out/profile.json``: the profile the predictions used, for :func:`repredict`;
    whole or not at all."""
    Path(out).mkdir(parents=True, exist_ok=True)
    return write_text_atomic(Path(out, "profile.json"), json.dumps(profile.to_json(), indent=1))


def cases(cfg: BenchConfig) -> list[Case]:
    """One case per network; its variants (the layouts) start their own 4 ranks each.
    Refuses (ValueError) too few ``cfg.extra["steps"]`` before anything runs."""
    _steps(cfg)
    return [Case(f"tiny/{RANKS} ranks", networks=True)]


def setup(cfg: BenchConfig, case: Case) -> Setup:
    """Each layout (and the planner's pick) is one variant: a whole training run on 4 ranks
    over the case's network, whose step times and memory are kept for the rows. A layout
    whose run fails (or times out) is not run again; its row says why, and the others are
    kept."""
    from distllm.testing.netem import EmulatedNetwork

    steps = _steps(cfg)
    profile = _profile(cfg)
    if cfg.out is not None:  # the profile the predictions used, for repredict()
        _write_profile(cfg.out, profile)
    stack = contextlib.ExitStack()
    net = None
    if case.net is not None:
        net = stack.enter_context(EmulatedNetwork(nranks=RANKS, rate=case.net))
        if not net.available:
            stack.close()
            return Setup(unavailable={case.net: net.reason})
    gpn = RANKS if case.net is None else 1  # emulated: every group crosses the slow link
    try:
        pick = _as_tuple(_planner_pick(profile, gpn))
        data = _corpus(stack.enter_context(tempfile.TemporaryDirectory(prefix="planval-")))
    except BaseException:
        stack.close()
        raise
    chosen = cfg.extra.get("layouts")
    chosen = [tuple(t) for t in (chosen if chosen is not None else
                                 QUICK_LAYOUTS if cfg.quick else LAYOUTS)]
    layouts = chosen + ([pick] if pick not in chosen else [])
    samples: dict[tuple, list[float]] = {t: [] for t in layouts}
    mem: dict[tuple, dict] = {}
    load: dict[tuple, list[float]] = {t: [] for t in layouts}
    tuning: dict[tuple, int] = {t: 0 for t in layouts}
    failed: dict[tuple, str] = {}  # layout -> why its run failed

    def measure(t: tuple) -> None:
        if t in failed:  # failed once: not run again
            return
        load[t].append(os.getloadavg()[0])  # the shared machine's load as this run starts
        try:
            got = _measure(t, steps + _trial_steps(t), net, data, probe=t not in mem)
        except Exception as e:  # noqa: BLE001 - a layout whose run fails is a row
            failed[t] = _failure(e)
            print(f"{case.net or 'loopback'} {_layout(t).name()}: {failed[t]}",
                  file=sys.stderr, flush=True)
            return
        samples[t] += got["times"]
        tuning[t] += got["tuning_steps"]
        mem.setdefault(t, got["mem"])
        print(f"{case.net or 'loopback'} {_layout(t).name()}: steps {got['times']}",
              file=sys.stderr, flush=True)

    def finish(stats) -> dict:
        return {"layouts": layouts, "samples": samples, "mem": mem, "profile": profile,
                "gpn": gpn, "pick": pick, "load": load, "tuning": tuning, "failed": failed}

    return Setup({_layout(t).name(): (lambda t=t: measure(t)) for t in layouts}, warmup=0,
                 reps=cfg.reps or int(cfg.extra.get("rounds", 1 if cfg.quick else 2)),
                 finish=finish,
                 close=stack.close)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    net_name = case.net or "loopback"
    if result.unavailable:
        return [row(SUITE, case.label, net_name, status="unavailable",
                    reason=result.unavailable[case.net])]
    i = result.info[0]
    return _rows(net_name, i["layouts"], i["samples"], i["mem"], i["profile"], i["gpn"],
                 i["pick"], i.get("load"), i.get("tuning"), i.get("failed"))


def _rows(net_name, layouts, samples, mem, profile, gpn, pick, load=None, tuning=None,
          failed=None) -> list[dict]:
    """A row per layout (``unavailable``, with why, for a layout in ``failed``), then the
    planner's first choice among the measured layouts and the search's pick, each against
    the fastest measured."""
    failed, case = failed or {}, f"tiny/{net_name}"
    ran = [t for t in layouts if t not in failed]
    pred = {t: _predict(t, profile, gpn) for t in ran}
    meas = {t: statistics.median(samples[t]) for t in ran}
    out = [row(SUITE, case, _layout(t).name(), status="unavailable", reason=failed[t],
               planner_pick=t == pick) if t in failed else
           _layout_row(case, t, pred[t], mem[t], samples[t], t == pick,
                       statistics.median(load[t]) if load and load.get(t) else None,
                       tuning.get(t) if tuning else None)
           for t in layouts]
    if not ran:  # every run failed: their rows say why
        return out
    ranked = sorted(ran, key=lambda t: pred[t].step_time_s)
    fastest = min(ran, key=lambda t: meas[t])
    for label, t in (("first among measured", ranked[0]), ("search's pick", pick)):
        name = f"planner {label}: {_layout(t).name()}"
        if t in failed:
            out.append(row(SUITE, case, name, status="unavailable", reason=failed[t]))
            continue
        out.append(row(SUITE, case, name, status="ok",
                       reason=f"fastest measured: {_layout(fastest).name()}",
                       slowdown_vs_fastest=meas[t] / meas[fastest] - 1))
    return out


def _layout_row(case: str, t: tuple, p, m: dict, samples: list[float], pick: bool,
                load_1min: float | None, tuning_steps: int | None) -> dict:
    """The row of one measured layout: its step times against the prediction ``p``, its
    memory ``m`` against the predicted."""
    return row(
        SUITE,
        case,
        _layout(t).name(),
        stats_of([x * 1e3 for x in samples]),
        predicted_ms=p.step_time_s * 1e3,
        time_error=p.step_time_s / statistics.median(samples) - 1,
        predicted_cpu_ms=p.time.get("cpu_busy", 0.0) * 1e3,
        predicted_mem_mb=p.memory["total"] / 1e6,
        measured_mem_mb=m["total"] / 1e6,
        mem_error=p.memory["total"] / m["total"] - 1,
        predicted_states_mb=(p.memory["total"] - p.memory["activations"]) / 1e6,
        measured_states_mb=m["states"] / 1e6,
        predicted_act_mb=p.memory["activations"] / 1e6,
        measured_step_peak_mb=m["step_peak"] / 1e6,
        mem_method=m.get("how"),
        ranks_cpu_ms=m["ranks_cpu_s"] * 1e3 if "ranks_cpu_s" in m else None,
        planner_pick=pick,
        mem_total_gb=m["total"] / 1e9,
        load_1min=load_1min,
        # steps after the warm-up that overlap="auto"'s trial took part in: not among the
        # samples unless fewer than MIN_TIMED steps were left without it
        overlap_tuning_steps=tuning_steps,
    )


def parse_layout(name: str) -> tuple:
    """The layout tuple of a row's variant name (``tp1.pp2.dp2.zero0.1f1b.m4.ckpt-full``)."""
    parts = name.split(".")
    tp, pp, dp, zero = (int(x.lstrip("tpdzero")) for x in parts[:4])
    rest = parts[4:]
    sch = rest.pop(0) if pp > 1 else "none"
    m = int(rest.pop(0)[1:])
    ck = rest[0].split("-", 1)[1] if rest and rest[0].startswith("ckpt-") else "none"
    return (tp, pp, dp, zero, sch, m, ck)


def flat(r: dict) -> dict:
    """A row with its ``extra`` fields lifted to the top level (for tables)."""
    return {**{k: v for k, v in r.items() if k != "extra"}, **(r.get("extra") or {})}


def repredict(results: Path, profile) -> list[dict]:
    """Rows of an earlier run with the predictions recomputed by the current cost model."""
    rows = [flat(r) for r in json.loads(Path(results).read_text())["rows"]]
    out = []
    for r in rows:
        if r.get("ms") is None or r.get("measured_mem_mb") is None:
            continue
        t = parse_layout(r["variant"])
        p = _predict(t, profile, RANKS if r["case"].endswith("loopback") else 1)
        out.append(
            dict(
                r,
                predicted_ms=p.step_time_s * 1e3,
                time_error=p.step_time_s * 1e3 / r["ms"] - 1,
                predicted_mem_mb=p.memory["total"] / 1e6,
                mem_error=p.memory["total"] / 1e6 / r["measured_mem_mb"] - 1,
                predicted_cpu_ms=p.time.get("cpu_busy", 0.0) * 1e3,
            )
        )
    return out
