"""The one timing module: how distllm times variants against each other.

Every measurement goes through here: the benchmark runner (``distllm bench``), the overlap
doctor, ``distllm plan --calibrate`` and the emulated-link check. The rules:

- **interleaved**: after ``warmup`` untimed rounds, the variants run in turn, A B C then
  C B A, so that drift of the machine hits every variant alike and none is always first;
- **samples, then a summary**: :func:`interleaved_samples` returns every repetition's
  milliseconds per variant; :func:`stats_of` gives the median, p10/p90 and minimum;
  repetition ``i`` of every variant ran in the same round, so a figure made of several
  variants (a speed-up, a hidden share) has a band taken round by round
  (:func:`paired_band`), in which a drift of the machine moves every term alike;
- **one clock per kind of work**: ``timer(fn) -> ms`` is :func:`wall_timer` (with a device
  synchronisation inside the timed region), :func:`cuda_event_timer` (GPU time on the
  current stream, the host's dispatch kept out of it by a busy-wait kernel queued first) or
  :func:`process_time_timer` (this process's CPU time);
- **across ranks, the slowest**: a step ends with its slowest rank, so multi-rank timings
  are reduced with MAX in one all-reduce (:func:`max_over_ranks`), on the group's device
  (NCCL takes CUDA tensors only).

The overlap tuner (``overlap="auto"``) calls the same two functions::

    samples = interleaved_samples(candidates, warmup=1, reps=reps, timer=wall_timer(sync),
                                  before_each=barrier)
    rounds = max_over_ranks([x for n in samples for x in samples[n]], group=g,
                            device=device)

(every repetition of every candidate, each the slowest rank's, in one all-reduce: every
rank of the group then chooses alike, which its collectives need; skipped on one process.
The choice compares the candidates round by round, ``overlap_tuner.paired_ratio``.
``errors=``, a dict that collects the candidates that raised and drops them, is there for
callers whose candidates may fail.)
``linear_gelu(backend="auto")`` times with :func:`interleaved_samples` alone: an op cannot
start a collective (the stages of a pipeline meet different shapes), so each process
chooses for itself; backends differ in rounding only, never in the collectives that follow.
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distllm.comm.collectives import all_reduce, group_device, reduce_scatter
from distllm.comm.compat import all_gather_into

__all__ = [
    "Timer",
    "Stats",
    "stats_of",
    "quantile",
    "paired_band",
    "PAIRED_MIN",
    "wall_timer",
    "cuda_event_timer",
    "process_time_timer",
    "interleaved_samples",
    "interleaved",
    "max_over_ranks",
    "max_over_ranks_timer",
    "time_collective",
    "COLLECTIVES",
]

Timer = Callable[[Callable[[], object]], float]  # timer(fn) -> milliseconds of one call


@dataclass
class Stats:
    """A variant's repetitions (ms): median, 10th/90th percentiles, minimum, count, samples."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int
    samples_ms: list[float]

    @property
    def spread(self) -> float:
        """Relative half-width of the p10..p90 band around the median."""
        return (self.p90_ms - self.p10_ms) / (2 * self.median_ms) if self.median_ms else 0.0


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# rounds a band taken round by round needs (else callers fall back to the variants' own bands)
PAIRED_MIN = 5


def paired_band(fn: Callable[..., float | None], *series: Sequence[float]
                ) -> tuple[float, float] | None:
    """``(p10, p90)`` of ``fn(x_i, y_i, ...)`` over the rounds ``i`` of ``series`` (one
    variant's repetitions each, in the order :func:`interleaved_samples` ran them), rounds
    where ``fn`` gives None left out; None unless every series has the same length, at
    least :data:`PAIRED_MIN`, and ``fn`` gave that many values. The ends are single rounds:
    a band says how far one round's figure strays, not how precise the median is."""
    n = len(series[0]) if series else 0
    if n < PAIRED_MIN or any(len(s) != n for s in series):
        return None
    vals = [v for v in (fn(*xs) for xs in zip(*series, strict=True)) if v is not None]
    if len(vals) < PAIRED_MIN:
        return None
    return quantile(vals, 0.1), quantile(vals, 0.9)


def stats_of(samples_ms: Sequence[float]) -> Stats:
    """The summary of one variant's samples (at least one)."""
    if not samples_ms:
        raise ValueError("stats_of: no samples (reps must be >= 1)")
    return Stats(statistics.median(samples_ms), quantile(samples_ms, 0.1),
                 quantile(samples_ms, 0.9), min(samples_ms), len(samples_ms), list(samples_ms))


def wall_timer(sync: Callable[[], None] | None = None) -> Timer:
    """Wall-clock ms of one call; ``sync`` (e.g. ``torch.cuda.synchronize``) runs inside the
    timed region, after the call, so that asynchronous work is counted."""

    def timer(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return (time.perf_counter() - t0) * 1e3

    return timer


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """What :func:`wall_timer` waits with for work on ``device``: that GPU's own
    ``synchronize`` (a bare ``torch.cuda.synchronize()`` waits for the current device, cuda:0
    where a rank never set its own, and would time the launches, not the kernels); None off
    CUDA."""
    return functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None


# the busy-wait cuda_event_timer queues before its start event: twice the longest host
# dispatch of the latest calls, within these bounds (ms); the longest when none is known yet
BUSY_WAIT_MS = (1.0, 50.0)
_dispatch_ms: collections.deque[float] = collections.deque(maxlen=16)  # host ms of fn() calls
_cycles_per_ms: dict[int, float] = {}  # per device: GPU clock cycles of torch.cuda._sleep a ms


def _sleep_cycles_per_ms(sleep: Callable[[int], None]) -> float:
    """How many cycles of ``sleep`` (``torch.cuda._sleep``) the current GPU spins in one ms,
    measured once per device with two CUDA events around four million cycles, themselves
    queued behind as many, so that the host's time between them is not measured."""
    dev = torch.cuda.current_device()
    if dev not in _cycles_per_ms:
        cycles = 4_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(cycles)
        start.record()
        sleep(cycles)
        end.record()
        end.synchronize()
        _cycles_per_ms[dev] = cycles / max(start.elapsed_time(end), 1e-3)
    return _cycles_per_ms[dev]


def _busy_wait_ms() -> float:
    lo, hi = BUSY_WAIT_MS
    return min(max(2.0 * max(_dispatch_ms), lo), hi) if _dispatch_ms else hi


def cuda_event_timer(fn: Callable[[], object]) -> float:
    """ms of GPU time of one call of ``fn``'s work on the current stream, between two CUDA
    events (work on a side stream is timed only where the current stream waits for it).

    The previous call ended with a synchronisation, so the GPU is idle: had the start event
    been recorded then, it would fire at once and the host's dispatch of ``fn`` up to its
    first kernel would be inside the interval, against variants with more Python per call.
    So a busy-wait kernel (``torch.cuda._sleep``) is queued before the start event, lasting
    twice the longest host dispatch of the latest calls (:data:`BUSY_WAIT_MS` bounds it; the
    host time of every call is kept): ``fn`` dispatches while the GPU spins, the start event
    fires when the spin ends with ``fn``'s kernels already queued, and the interval is the
    GPU's. Still inside it: dispatch longer than the wait, and any host synchronisation
    within ``fn`` (after which the GPU idles while the host dispatches). ``torch.cuda._sleep``
    is private; where a torch lacks it nothing is queued and the dispatch is timed too. Each
    call is timed on its own, so :func:`interleaved_samples` interleaves variants as ever."""
    sleep = getattr(torch.cuda, "_sleep", None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep is not None:
        sleep(int(_busy_wait_ms() * _sleep_cycles_per_ms(sleep)))
    start.record()
    t0 = time.perf_counter()
    fn()
    _dispatch_ms.append((time.perf_counter() - t0) * 1e3)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def process_time_timer(fn: Callable[[], object]) -> float:
    """ms of this process's CPU time for one call: on a machine shared with other jobs the
    wall clock measures the neighbours; with one torch thread CPU time is the work done."""
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1e3


def interleaved_samples(
    variants: dict[str, Callable[[], object]],
    *,
    warmup: int = 1,
    reps: int = 5,
    timer: Timer | None = None,
    before_each: Callable[[], object] | None = None,
    errors: dict[str, str] | None = None,
) -> dict[str, list[float]]:
    """Time each variant ``reps`` times, interleaved (A B C, C B A, ...), after ``warmup``
    untimed rounds; the ms of every repetition per variant.

    ``timer`` defaults to :func:`wall_timer` without synchronisation. ``before_each`` runs
    before each call, outside the timed region (e.g. a barrier across ranks). ``errors``:
    when a dict is given, a variant that raises is recorded there as ``"Type: message"``
    and dropped from the later rounds and from the result (on one process only: ranks that
    dropped different variants would pair different collectives); otherwise it raises.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps={reps}, warmup={warmup}: need reps >= 1 and warmup >= 0")
    timer = timer or wall_timer()
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}

    def call(n: str) -> float | None:
        if before_each is not None:
            before_each()
        if errors is None:
            return timer(variants[n])
        try:
            return timer(variants[n])
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, not fatal
            first = str(exc).splitlines()[0] if str(exc) else ""
            errors[n] = f"{type(exc).__name__}: {first}"
            return None

    for i in range(warmup + reps):
        order = names if i < warmup or (i - warmup) % 2 == 0 else names[::-1]
        for n in order:
            if errors is not None and n in errors:
                continue
            t = call(n)
            if i >= warmup and t is not None:
                samples[n].append(t)
    return {n: s for n, s in samples.items() if errors is None or n not in errors}


def interleaved(variants: dict[str, Callable[[], object]], **kw) -> dict[str, Stats]:
    """:func:`interleaved_samples` (same keywords), each variant summarised as
    :class:`Stats`."""
    return {n: stats_of(s) for n, s in interleaved_samples(variants, **kw).items()}


def _timing_device(group, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return group_device(group)


def max_over_ranks(values: Sequence[float], group=None, device=None) -> list[float]:
    """Element-wise MAX over the ranks of ``group`` of this rank's timings, in one
    all-reduce on ``device`` (default: the group's, CUDA for NCCL); collective. Without an
    initialised process group (or with one rank) the values are returned as they are."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                     device=_timing_device(group, device))
    all_reduce(t, group=group, op=dist.ReduceOp.MAX)
    return t.tolist()  # the one host read of this measurement


def max_over_ranks_timer(timer: Timer | None = None, group=None, device=None) -> Timer:
    """``timer(fn) -> ms`` for multi-rank variants: ``timer`` (default :func:`wall_timer`) on
    this rank, then the max over the ranks of ``group`` (a step ends with its slowest rank)."""
    inner = timer or wall_timer()

    def timed(fn: Callable[[], object]) -> float:
        return max_over_ranks([inner(fn)], group, device)[0]

    return timed


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def time_collective(op: str, numel: int, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", group=None, reps: int = 9,
                    warmup: int = 1) -> list[float]:
    """ms of each of ``reps`` blocking collectives ``op`` (one of :data:`COLLECTIVES`) over
    ``numel`` elements (the full, unsharded tensor; rounded up to a multiple of the group
    size) on ``group``, after ``warmup`` more; a barrier before each, and each repetition's
    time the MAX over ranks. Collective: call it on every rank of ``group``. Each is the
    collective the layers run: :func:`distllm.comm.collectives.all_reduce` (on 2 gloo ranks
    one exchange) and :func:`~distllm.comm.collectives.reduce_scatter`, and the all-gather of
    :func:`distllm.comm.compat.all_gather_into`."""
    if op not in COLLECTIVES:
        raise ValueError(f"time_collective: op={op!r}; choose one of {', '.join(COLLECTIVES)}")
    world = dist.get_world_size(group)
    n = -(-numel // world) * world
    full = torch.zeros(n, dtype=dtype, device=device)  # zeros: sums stay finite and exact
    part = full[: n // world].clone()
    fn = {"all_reduce": lambda: all_reduce(full, group=group),
          "all_gather": lambda: all_gather_into(full, part, group=group),
          "reduce_scatter": lambda: reduce_scatter(part, full, group=group)}[op]
    samples = interleaved_samples({op: fn}, warmup=warmup, reps=reps,
                                  timer=wall_timer(device_sync(full.device)),
                                  before_each=lambda: dist.barrier(group=group))[op]
    return max_over_ranks(samples, group, full.device)
