"""The one runner of the benchmark suites: each suite says how to build its variants for a
case; the runner starts the ranks, times the variants and hands the timings back for rows.

A suite is a module (``bench/<name>.py``) with four names:

- ``SUITE``: the name its rows carry (unless a case names another);
- ``cases(cfg) -> list[Case]``: what to measure; shapes come from :func:`shapes` (the
  explicit ``--shapes "M,K,N;M,K,N"`` or the suite's presets), and a case that cannot run
  here carries its reason (``skip``) and becomes one ``unavailable`` row;
- ``setup(cfg, case) -> Setup``: builds the variants of one case (callables, one call each
  per repetition), and says which cannot run here and why; on ``case.ranks`` gloo ranks it
  runs in every rank (over the emulated link of ``cfg.net`` when ``case.networks``);
- ``rows(cfg, case, result) -> list[dict]``: the rows (:func:`distllm.bench.rows.row`) of
  one case from its :class:`Result`.

The runner (:func:`run_case`) times the variants with
:func:`distllm.diagnostics.timing.interleaved`: ``warmup`` untimed rounds, then repetitions
in turn (A B C, C B A, ...) so that drift of the machine hits every variant alike; each
variant's median with the 10th/90th percentiles as spread. On several ranks a barrier
precedes each call and each time is the slowest rank's. Ratios between variants are
meaningful within one run; absolute times only on the machine recorded in the row.

The variants of a case share one process, and so one C heap. glibc gives freed memory back
to the kernel once enough of it is free at the top of the heap, and the next allocation of
it page-faults again; with two models in one process, whether a variant's step faults then
depends on what the *other* variant freed. Measured on one rank at 6x768 (4 x 64 tokens, one
thread): distllm's step took 43,744 minor faults a step, about 0.1 s of its 1.1 s, and
torch's step, run next in the same round, none; each alone in its own process, both fault
on some steps (up to 30,000) and not on others. So :func:`measure` first has glibc keep
freed memory (:func:`keep_freed_memory`), as jemalloc or tcmalloc would: no variant pays for
another's frees, and neither pays for its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from distllm.bench.rows import row

from distllm.diagnostics.timing import (
    Stats,
    Timer,
    interleaved,
    max_over_ranks_timer,
    wall_timer,
)
from distllm.train.host_memory import keep_freed_memory

__all__ = ["BenchConfig", "Case", "Setup", "Result", "LoopStep", "loop_aware", "shapes",
           "parse_shapes", "networks", "run_case", "run", "keep_freed_memory"]

_SHAPE = re.compile(r"^\s*-?\d+(\s*,\s*-?\d+)+\s*$")


@dataclass
class BenchConfig:
    """What a benchmark suite is asked to run."""

    quick: bool = False  # a tiny shape set for CI and a first look (whole suite < 5 min, 2 cores)
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"  # "float32", "bfloat16", "float16"
    shapes: str | None = None  # explicit "M,K,N;M,K,N" (else each suite's presets)
    net: str | None = None  # emulated link rate for multi-rank suites, e.g. "2gbit"
    out: Path | None = None  # where plots/traces may be written
    reps: int | None = None  # override the suite's repetition count
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    """One case of a suite: the variants timed against each other, reported together."""

    label: str  # shown while it runs; the rows' own case names may add the network
    params: dict[str, Any] = field(default_factory=dict)  # what setup() needs (shape, kind...)
    ranks: int = 0  # gloo ranks the runner starts for setup(); 0: in this process
    networks: bool = False  # run over loopback and the emulated link of cfg.net
    suite: str | None = None  # the suite of its rows, when the module serves several
    skip: str = ""  # why it cannot run here: one unavailable row, nothing run
    timeout: float = 1800.0  # seconds for the ranks of one run
    net: str | None = None  # set by the runner: the link rate of this run (None: loopback)


@dataclass
class Setup:
    """What ``setup(cfg, case)`` returns: the variants and how to time them.

    ``finish(stats)`` runs after the timing, in the same process(es) (every rank: it may be
    collective), and returns what ``rows()`` needs besides the times (a traced step, memory).
    ``close()`` runs last, even on failure."""

    variants: dict[str, Callable[[], object]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # variant -> why not here
    warmup: int = 2
    reps: int = 5
    timer: Timer | None = None  # default wall clock; on ranks, the max over them of it
    before_each: Callable[[], object] | None = None  # default on ranks: a barrier
    finish: Callable[[dict[str, Stats]], Any] | None = None
    close: Callable[[], object] | None = None


@dataclass
class Result:
    """One run of a case: rank 0's timings, the variants that could not run, ``finish()``'s
    return per rank (one entry in-process) and the network the ranks used."""

    stats: dict[str, Stats]
    unavailable: dict[str, str]
    info: list[Any]
    net: str = "loopback"  # the emulated rate, or "loopback"
    net_reason: str = ""  # why an asked-for emulated link fell back to loopback


def build_and_step(build: Callable[[], Any], first: Callable[[Any], object]
                   ) -> tuple[Any, str | None]:
    """``(built, None)``: ``build()``, whose first step ``first(built)`` ran; or ``(None,
    why)`` where either raised, ``why`` one line for the variant's ``unavailable`` row (a
    variant that builds but cannot run a shape must not take its case down in the timing).
    Every rank runs the same code: a failure here is every rank's."""
    what = ""
    try:
        built = build()
        what = "its first step failed: "
        first(built)
        return built, None
    except Exception as e:  # noqa: BLE001 - a variant that cannot run here is a row
        return None, f"{what}{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def parse_shapes(spec: str) -> list[tuple[int, ...]]:
    """``--shapes`` (``"M,K,N;M,K,N"``; a suite may take more or fewer integers a shape, e.g.
    train_e2e's ``"L,H,B,S[,M]"``) as tuples. Raises ValueError, naming ``--shapes``, for a
    shape that is not a list of integers or has a dimension below 1, and for no shape."""
    parts = [s.strip() for s in spec.split(";") if s.strip()]
    if not parts:
        raise ValueError(f"--shapes {spec!r}: no shape given; write 'M,K,N;M,K,N' "
                         "(e.g. '128,256,512;7,769,1000')")
    out = []
    for s in parts:
        if not _SHAPE.match(s):
            raise ValueError(f"--shapes: {s!r} is not a list of integers; write "
                             "'M,K,N;M,K,N' (e.g. '128,256,512;7,769,1000')")
        dims = tuple(int(v) for v in s.split(","))
        if min(dims) < 1:
            raise ValueError(f"--shapes: {s!r} has a dimension of {min(dims)}; every "
                             "dimension must be at least 1")
        out.append(dims)
    return out


def shapes(cfg: BenchConfig, presets: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The explicit ``cfg.shapes`` (``"M,K,N;M,K,N"``, see :func:`parse_shapes`) as tuples,
    else ``presets``."""
    if cfg.shapes and "," in cfg.shapes:
        return parse_shapes(cfg.shapes)
    return list(presets)


def networks(cfg: BenchConfig) -> list[str | None]:
    """The links a multi-rank case runs over: loopback (None), and ``cfg.net`` when given;
    a quick run with ``--net`` runs on that link only."""
    if not cfg.net:
        return [None]
    return [cfg.net] if cfg.quick else [None, cfg.net]


class LoopStep:
    """One step of a training loop whose steps leave work in flight for the next one (ZeRO-1/2
    launch the all-gather of the updated parameters at the end of ``step``; the next forward
    waits for each bucket before the layer that uses it).

    Timing such a step alone misleads either way: the barrier before the next call would
    absorb its all-gathers untimed, and waiting for them inside the call would charge them
    in full, as if no forward ran beside them. So a call runs three steps and times the
    middle one, which starts with the first step's work in flight and leaves its own to the
    third, as a step of a loop does; then ``drain`` waits for what is left, so the next call
    starts clean. The harness's timer reads :attr:`ms` (:func:`loop_aware`). The middle step
    is timed on the host clock; ``sync`` (e.g. ``torch.cuda.synchronize`` for a step that
    queues device work) runs at both ends of it, inside the timed region at the end.
    """

    def __init__(self, step: Callable[[], object], drain: Callable[[], object],
                 sync: Callable[[], object] | None = None) -> None:
        self.step, self.drain, self.sync = step, drain, sync
        self.ms: float | None = None

    def __call__(self) -> None:
        self.step()
        if self.sync is not None:
            self.sync()
        t0 = time.perf_counter()
        self.step()
        if self.sync is not None:
            self.sync()
        self.ms = (time.perf_counter() - t0) * 1e3
        self.step()
        self.drain()


def loop_aware(timer: Timer) -> Timer:
    """``timer`` of a call, except for a :class:`LoopStep`: the time of its middle step."""

    def timed(fn: Callable[[], object]) -> float:
        ms = timer(fn)
        return fn.ms if isinstance(fn, LoopStep) and fn.ms is not None else ms

    return timed


def measure(s: Setup, distributed: bool) -> tuple[dict[str, Stats], Any]:
    """Time ``s``'s variants (interleaved) and run its ``finish``; ``distributed``: this is
    one of several ranks (a barrier before each call, the slowest rank's time). A
    :class:`LoopStep` variant counts the time of its middle step. glibc keeps freed memory
    from here on (:func:`keep_freed_memory`)."""
    import torch.distributed as dist

    keep_freed_memory()
    timer, before = loop_aware(s.timer or wall_timer()), s.before_each
    if distributed:
        timer, before = max_over_ranks_timer(timer), before or dist.barrier
    try:
        stats = interleaved(s.variants, warmup=s.warmup, reps=s.reps, timer=timer,
                            before_each=before) if s.variants else {}
        info = s.finish(stats) if s.finish is not None else None
    finally:
        if s.close is not None:
            s.close()
    return stats, info


def _rank_case(modname: str, cfg: BenchConfig, case: Case) -> dict:
    """One rank of a multi-rank case (started by :func:`run_case`)."""
    s = importlib.import_module(modname).setup(cfg, case)
    stats, info = measure(s, distributed=True)
    return {"stats": stats, "unavailable": s.unavailable, "info": info}


def run_case(mod: ModuleType, cfg: BenchConfig, case: Case) -> list[dict]:
    """The rows of one case of suite module ``mod``, over each network it runs on.

    Where the emulated link of ``cfg.net`` cannot be built, the ranks fall back to loopback;
    when loopback is measured in the same call already, the fallback is not run again
    (its rows would repeat the loopback rows' keys): one ``unavailable`` row, case
    ``"<label> <rate>"``, says why the rate was not measured."""
    from distllm.testing import run_distributed
    from distllm.testing.netem import open_network

    if case.skip:
        return [row(case.suite or mod.SUITE, case.label, "-", status="unavailable",
                    reason=case.skip)]
    out: list[dict] = []
    loopback_done = False
    for rate in networks(cfg) if case.networks else [None]:
        c = dataclasses.replace(case, net=rate)
        if c.ranks:
            with open_network(rate, c.ranks) as net:
                if rate and net.label != str(rate) and loopback_done:
                    out.append(row(case.suite or mod.SUITE, f"{case.label} {rate}", "-",
                                   status="unavailable", reason=net.reason, net=str(rate)))
                    continue
                per = run_distributed(_rank_case, c.ranks, mod.__name__, cfg, c,
                                      timeout=c.timeout, setup=net.setup, env=net.env)
            res = Result(per[0]["stats"], per[0]["unavailable"], [p["info"] for p in per],
                         net.label, net.reason)
        else:
            s = mod.setup(cfg, c)
            stats, info = measure(s, distributed=False)
            res = Result(stats, s.unavailable, [info], rate or "loopback")
        loopback_done = loopback_done or res.net == "loopback"
        out += mod.rows(cfg, c, res)
    return out


def run(mod: ModuleType, cfg: BenchConfig) -> list[dict]:
    """Every case of suite module ``mod``, in order (``distllm bench`` adds progress and
    failure rows around the same calls: :func:`distllm.bench.suite.run_suites`)."""
    return [r for case in mod.cases(cfg) for r in run_case(mod, cfg, case)]
