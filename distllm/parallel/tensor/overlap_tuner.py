"""``overlap="auto"``: choose the chunk count of an overlap engine (or no overlap) from a
measurement on the real tensors, cached per (collective, shape, dtype, device, group).

Two rounds. The first times the compute alone, the sequential schedule and each chunk count
(pieces of :func:`distllm.parallel.tensor.overlap.pipeline_bounds`, first and last halved),
and where work follows the collective's launch (the weight-gradient GEMM of a backward) one
piece too: the whole GEMM, its collective running behind that work, as Megatron-LM's
asynchronous input-gradient all-reduce does;
from it, the GEMM time G and the collective's C = sequential - compute give the geometric
schedules of the second round: pieces growing by C/G (G/C for the all-gather, whose
collective comes before its GEMM), so that each piece's GEMM lasts as long as the previous
piece's collective (bounded so that no piece is more than :data:`MAX_PIECE_RATIO` times
another: a tiny GEMM loses efficiency). The second round times those against the sequential
schedule and the first round's best, interleaved, and the fastest is kept. The winner of
that selection must then beat the sequential schedule again in a confirmation round of its
own (the fastest of several noisy candidates is biased toward a lucky draw), by the margin
both in its fastest repetition and in the median of its paired ratios: each round of the
confirmation runs both schedules back to back, and the round's ratio (chosen over
sequential) is taken there, so that a drift of the machine between rounds moves both sides
of it, as in the benchmarks' verdicts. On 2 loopback ranks a chunked schedule whose fastest
repetition won by 5% ran 8% slower by median in the same layer's benchmark.

Every round goes through :mod:`distllm.diagnostics.timing`: interleaved repetitions after a
warm-up round, a barrier over the group before each, each candidate keeping its fastest
repetition (interference from other work only ever adds time, so the minimum is the steadier
estimate of what a schedule costs), each repetition's time the MAX over the ranks (a schedule
ends with its slowest rank), so that all ranks see the same numbers and choose the same
schedule (a mismatch would pair different collectives). A chunked schedule
is chosen only when it beats the sequential one by more than ``margin`` (3%); otherwise the
layer falls back to no overlap and says so once through ``logging.getLogger("distllm")``.

On CPU the confirmation is not a round of its own but a **trial in the step**: the next
``TRIAL_ROUNDS`` rounds of calls that share the shape's key (every layer of that shape, in
the training step itself) each run the sequential schedule, the selection's winner and up to
two more chunked schedules (:func:`_trial_plans`: a geometric winner's equal-piece twin, the
first round's fastest equal-piece count, the layer's own ``chunks``), once each, in an order
that rotates from round to round, each call timed as it runs there; then one all-reduce over
the group of those times (MAX over the ranks) decides: of the chunked schedules that beat
sequential by the margin in the median of their ratios to it in the same round, and were
faster than it in at least :data:`TRIAL_WIN_SHARE` of the rounds, the one with the lowest
median ratio is kept; if none did, the layer runs sequential. The twin is there because the
geometric sizing models a core that the collective leaves alone: at (2048, 512, 2048) over an
emulated 2 Gbit/s link on 2 cores, 8 pieces growing by 1.49 won the isolated rounds, and
then ran 1.11x the time of 8 equal pieces (median of 14 paired rounds, the second-lowest and
second-highest ratios 0.94 and 1.22, the same GEMM).

On CPU the GEMM and gloo's copies and TCP share the rank's cores, so what a schedule costs
depends on what runs beside it: at tp2 over an emulated 2 Gbit/s link (2 cores), isolated
rounds with a barrier before each repetition measured the chunked schedules of one shape
anywhere from 0.75x to 1.46x of sequential from one round to the next, while in the training
step the overlap doctor profiled the column-parallel backward of every layer 10-25% faster
chunked than sequential. Every rank of the group makes the same calls in the same order, so
the trial runs the same schedule at the same call everywhere and decides at the same call.
``TRIAL_ROUNDS = 0`` turns the trial off (the isolated confirmation round decides, as on
CUDA, where the GEMM does not share a core with the collective). While a trial runs, the
layer's plan says so (``OverlapPlan.tuning``; :func:`distllm.parallel.tensor.settle_overlap`
runs a step until every trial is over).

The cache is a measurement record (not configuration): :func:`clear_cache` empties it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distllm.diagnostics.timing import device_sync, interleaved_samples, max_over_ranks, wall_timer
from distllm.parallel.tensor.overlap import CommContext, NullComm

__all__ = ["Choice", "Trial", "choose", "clear_cache", "generation", "geometric_growth",
           "paired_ratio", "trial_calls", "CANDIDATES", "MAX_PIECE_RATIO", "TRIAL_ROUNDS",
           "TRIAL_SCHEDULES", "TRIAL_WIN_SHARE"]

log = logging.getLogger("distllm")

CANDIDATES = (2, 4, 8)
# repetitions of the confirmation round: its winner must beat the sequential schedule both in
# its fastest repetition and in the median of its rounds' ratios (a schedule that is fast only
# on a lucky draw, as a chunked one on loopback, where gloo's copies take the GEMM's core, is
# not kept)
CONFIRM_REPS = 7
# rounds of the trial in the step (CPU; 0: the isolated confirmation round instead), each
# running at most TRIAL_SCHEDULES schedules once (sequential and up to three chunked ones)
TRIAL_ROUNDS = 8
TRIAL_SCHEDULES = 4
# a schedule the trial keeps beats sequential by the margin in the median of its rounds' ratios
# AND is faster than sequential in at least this share of its rounds (6 of 8): on 2 loopback
# ranks, 4 chunks kept at median ratios 0.955 and 0.932 ran 0.90x and 0.91x of sequential's
# speed in the benchmark that followed
TRIAL_WIN_SHARE = 0.75
_CACHE: dict[tuple, Choice] = {}


@dataclass(frozen=True)
class Choice:
    """The outcome of one measurement: ``chunks`` (0 = no overlap), the times (ms, best of
    the repetitions) of the compute alone, of the sequential schedule and of the chosen one,
    and the reason."""

    chunks: int
    compute_ms: float
    sequential_ms: float
    chosen_ms: float
    reason: str
    growth: float | None = None  # the geometric schedule's ratio (None: first/last halved)
    trial: Trial | None = field(default=None, compare=False)  # the trial in the step, running

    @property
    def comm_ms(self) -> float:
        """Standalone communication time: sequential minus compute."""
        return max(0.0, self.sequential_ms - self.compute_ms)


_generation = 0  # bumped by clear_cache: a layer's memo of its choices is valid within one


def generation() -> int:
    """The cache's generation: it changes whenever :func:`clear_cache` forgets the choices."""
    return _generation


def clear_cache() -> None:
    """Forget every measured choice (the next call of each shape measures again)."""
    global _generation
    _CACHE.clear()
    _generation += 1


_pinned = False


def pin() -> None:
    """From now on ``overlap="auto"`` runs the sequential schedule, without timing
    (``distllm train --deterministic``: the timing picks by the machine's load, and schedules
    that split a collective differently need not give the same bits); ``overlap="chunked"``
    stays a fixed overlap. Choices made before are dropped."""
    global _pinned
    _pinned = True
    clear_cache()


def unpin() -> None:
    """Undo :func:`pin`: ``overlap="auto"`` measures again."""
    global _pinned
    if _pinned:
        _pinned = False
        clear_cache()


def pinned() -> bool:
    """Whether :func:`pin` fixed the choices."""
    return _pinned


MAX_PIECE_RATIO = 16.0  # largest over smallest piece of a geometric schedule


def _timed(variants: dict[str, Callable[[], object]], comm: CommContext, device: torch.device,
           reps: int) -> dict[str, list[float]]:
    """Each variant's ms in each of ``reps`` interleaved rounds, each repetition the MAX over
    the group (collective: every rank, same order)."""
    sync = device_sync(device)
    samples = interleaved_samples(variants, warmup=1, reps=reps, timer=wall_timer(sync),
                                  before_each=lambda: dist.barrier(group=comm.group))
    names = list(samples)
    # on the group's device (NCCL takes CUDA tensors only); read back once per round
    vals = max_over_ranks([x for n in names for x in samples[n]], comm.group, device)
    return {n: vals[i * reps:(i + 1) * reps] for i, n in enumerate(names)}


def _fastest(samples: dict[str, list[float]]) -> dict[str, float]:
    return {n: min(xs) for n, xs in samples.items()}


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round (below 1: ``a``
    faster). Rounds are paired by position: :func:`_timed` runs every variant once per
    round."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


def geometric_growth(compute_ms: float, comm_ms: float, chunks: int, comm_first: bool
                     ) -> float | None:
    """The ratio of consecutive pieces that balances each piece's GEMM against the previous
    piece's collective (``comm_first``: the all-gather, whose collective precedes its GEMM),
    bounded by :data:`MAX_PIECE_RATIO`; None when either time is unknown, or the schedule
    would be within 5% of equal pieces."""
    if compute_ms <= 0 or comm_ms <= 0 or chunks < 2:
        return None
    g = compute_ms / comm_ms if comm_first else comm_ms / compute_ms
    bound = MAX_PIECE_RATIO ** (1.0 / (chunks - 1))
    g = min(max(g, 1.0 / bound), bound)
    return None if abs(g - 1.0) < 0.05 else g


def _full_key(comm: CommContext, key: tuple) -> tuple:
    """The cache's key: a layer's ``key`` on the group of ``comm``."""
    return (comm.backend, comm.ranks, *key)


def _describe(chunks: int, growth: float | None) -> str:
    if chunks == 1:
        return "1 piece (the collective runs behind the GEMM that follows)"
    return f"{chunks} chunks" + (f" growing by {growth:.2f}" if growth is not None else "")


def trial_calls() -> int:
    """The most calls of one shape a trial in the step takes: :data:`TRIAL_ROUNDS` rounds of
    at most :data:`TRIAL_SCHEDULES` schedules (sequential, the selection's winner, its
    equal-piece twin, the first round's fastest count and the layer's own, as
    :func:`_trial_plans` takes them)."""
    return TRIAL_ROUNDS * TRIAL_SCHEDULES


def _trial_plans(plans: dict[str, tuple[int, float | None]], best: str,
                 first_best: str | None, chunks_hint: int) -> dict[str, tuple[int, float | None]]:
    """The schedules of a trial in the step, at most :data:`TRIAL_SCHEDULES`: sequential, the
    selection's winner ``best``, then, where they differ from what is already in, the winner's
    equal-piece twin (a geometric winner's chunk count in equal pieces: whether the sizing
    pays in the step, where gloo's copies share the GEMM's core, is the step's to say), the
    first round's fastest equal-piece count ``first_best`` and the layer's own
    ``chunks_hint``."""
    out = {"sequential": (0, None), best: plans[best]}
    chunks, growth = plans[best]
    twin = str(chunks) if growth is not None else None
    for name in (twin, first_best, str(chunks_hint)):
        if len(out) >= TRIAL_SCHEDULES:
            break
        if name is not None and name in plans and name not in out:
            out[name] = plans[name]
    return out


def choose(key: tuple, run: Callable[..., object], comm: CommContext, rows: int,
           device: torch.device, what: str, chunks_hint: int = 4, reps: int = 5,
           margin: float = 0.03, comm_first: bool = False, one_piece: bool = False) -> Choice:
    """The cached :class:`Choice` for ``key``; measured on first use.

    ``run(comm, chunks, growth=None)`` runs the schedule once (``chunks=0``: sequential;
    ``growth``: a geometric schedule, see :func:`distllm.parallel.tensor.overlap.
    pipeline_bounds`); ``rows`` bounds the chunk counts tried; ``device`` is where the
    layer's tensors live (the timings are reduced over the group there; CUDA is synchronised
    inside each timed run); ``what`` names the layer in the log line; ``comm_first``: the
    collective precedes the GEMM (all-gather); ``one_piece``: work follows the collective's
    launch (the weight-gradient GEMM of a backward), so one piece, the whole GEMM with its
    collective running behind that work, is a candidate too.
    """
    full_key = _full_key(comm, key)
    if full_key in _CACHE:
        return _CACHE[full_key]
    if comm.world == 1:
        ch = Choice(0, 0.0, 0.0, 0.0, "tp=1: nothing to communicate")
    elif _pinned:
        ch = Choice(0, 0.0, 0.0, 0.0, "no overlap: pinned (deterministic), not timed")
    else:
        ch = _measure_and_choose(key, run, comm, rows, device, what, chunks_hint, reps, margin,
                                 comm_first, one_piece)
    _CACHE[full_key] = ch
    return ch


def _measure_and_choose(key, run, comm, rows, device, what, chunks_hint, reps, margin,
                        comm_first, one_piece=False) -> Choice:
    null = NullComm(comm)
    cands = sorted({c for c in (*CANDIDATES, chunks_hint) if 2 <= c <= rows}
                   | ({1} if one_piece else set()))
    first: dict[str, Callable[[], object]] = {
        "compute": lambda: run(null, 1),
        "sequential": lambda: run(comm, 0),
    }
    for c in cands:
        first[str(c)] = lambda c=c: run(comm, c)
    t = _fastest(_timed(first, comm, device, reps))
    plans: dict[str, tuple[int, float | None]] = {str(c): (c, None) for c in cands}
    chunked = {n: t[n] for n in plans}
    best = first_best = min(chunked, key=chunked.get) if chunked else None
    comm_ms = max(0.0, t["sequential"] - t["compute"])
    second: dict[str, Callable[[], object]] = {}
    for c in sorted({c for c in (4, 8, chunks_hint) if 2 <= c <= rows}):
        g = geometric_growth(t["compute"], comm_ms, c, comm_first)
        if g is not None:
            name = f"{c}x{g:.2f}"
            plans[name] = (c, g)
            second[name] = lambda c=c, g=g: run(comm, c, g)
    if second:  # the geometric schedules against the sequential one and the best so far
        second["sequential"] = first["sequential"]
        if best is not None:
            second[best] = first[best]
        t2 = _fastest(_timed(second, comm, device, reps))
        chunked = {n: v for n, v in t2.items() if n != "sequential"}
        best = min(chunked, key=chunked.get)
        t = {**t, **t2}
    if best is not None and device.type == "cpu" and TRIAL_ROUNDS > 0:
        # on CPU the step decides (Trial), in the next calls of this key
        trial_plans = _trial_plans(plans, best, first_best, chunks_hint)
        return Choice(0, t["compute"], t["sequential"], t["sequential"],
                      f"trial in the step: {', '.join(trial_plans)}", None,
                      Trial(key, comm, device, what, margin, trial_plans, t))
    if best is not None and t[best] < t["sequential"] * (1 - margin):
        # the winner of a selection among noisy candidates is biased toward a lucky draw:
        # confirm it against the sequential schedule in a round of its own
        runs = {**first, **second}
        s3 = _timed({"sequential": runs["sequential"], best: runs[best]}, comm, device,
                    CONFIRM_REPS)
        t3 = _fastest(s3)
        t = {**t, **t3}
        paired = paired_ratio(s3, best, "sequential")
        if not t3[best] < t3["sequential"] * (1 - margin):
            how = "in its fastest repetition"
        elif not paired < 1 - margin:
            how = f"in its rounds (median ratio to sequential {paired:.3f})"
        else:
            how = ""
        if how:
            why = f"{best} won the selection but not its confirmation {how} ({t3[best]:.2f} ms)"
            return _fallback(key, comm, what, t, why)
        c, g = plans[best]
        shape = _describe(c, g)
        return Choice(c, t["compute"], t["sequential"], t[best],
                      f"{shape}: {t[best]:.2f} ms vs sequential {t['sequential']:.2f} ms "
                      f"(median ratio of its rounds {paired:.3f})", g)
    why = f"best chunked {t[best]:.2f} ms" if best else "too few rows to chunk"
    return _fallback(key, comm, what, t, why)


def _fallback(key, comm, what: str, t: dict[str, float], why: str) -> Choice:
    ch = Choice(0, t["compute"], t["sequential"], t["sequential"],
                f"no overlap: {why} vs sequential {t['sequential']:.2f} ms")
    log.warning("%s %s on %s x%d: overlap falls back to none (%s)", what, key,
                comm.backend, comm.world, ch.reason)
    return ch


def _time_call(fn: Callable[[], object], name: str) -> tuple[object, float]:
    """``(fn(), its wall ms)``: how a trial times one call of its schedule ``name`` on this
    rank."""
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


@dataclass(eq=False)
class Trial:
    """A trial in the step (see the module docstring): ``plans`` maps each schedule's name to
    its ``(chunks, growth)`` (``sequential`` first, ``(0, None)``). :meth:`schedule` says what
    the next call of the key runs; :meth:`run` runs it, timed, and at the trial's last call
    decides (collective over the group: every rank reaches it at the same call) and puts the
    final :class:`Choice` in the cache."""

    key: tuple
    comm: CommContext
    device: torch.device
    what: str
    margin: float
    plans: dict[str, tuple[int, float | None]]
    isolated: dict[str, float]  # the selection's fastest repetitions (ms)
    rounds: int = field(default_factory=lambda: TRIAL_ROUNDS)
    calls: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        return self.rounds * len(self.plans)

    @property
    def done(self) -> bool:
        return self.calls >= self.total_calls

    def _name_now(self) -> str:
        names = list(self.plans)
        rnd, pos = divmod(self.calls, len(names))
        return names[(pos + rnd) % len(names)]  # each round runs each once, rotated

    def schedule(self) -> tuple[str, int, float | None]:
        """``(name, chunks, growth)`` of the next call (``chunks`` 0: sequential)."""
        name = self._name_now()
        return (name, *self.plans[name])

    def run(self, fn: Callable[[], object], comm: CommContext) -> object:
        """Run ``fn``, the call of :meth:`schedule`'s schedule, timed; the trial's last call
        decides, over ``comm``: the calling layer's group (the one the trial began on may
        have been destroyed since, and the same ranks' group made again)."""
        self.comm = comm
        name = self._name_now()
        out, ms = _time_call(fn, name)
        self.samples.setdefault(name, []).append(ms)
        self.calls += 1
        if self.done:
            self._decide()
        return out

    def _decide(self) -> None:
        names = list(self.plans)
        vals = max_over_ranks([x for n in names for x in self.samples[n]], self.comm.group,
                              self.device)
        per = {n: vals[i * self.rounds:(i + 1) * self.rounds] for i, n in enumerate(names)}
        ratios = {n: paired_ratio(per, n, "sequential") for n in names[1:]}
        wins = {n: sum(x < y for x, y in zip(per[n], per["sequential"], strict=True))
                for n in ratios}
        need = math.ceil(TRIAL_WIN_SHARE * self.rounds)
        said = ", ".join(f"{n} {r:.3f}" for n, r in ratios.items())
        how = (f"median ratio to sequential over {self.rounds} rounds of calls in the step: "
               f"{said}")
        fast = [n for n in ratios if ratios[n] < 1 - self.margin]
        ok = [n for n in fast if wins[n] >= need]
        t = self.isolated
        if ok:
            best = min(ok, key=ratios.get)
            c, g = self.plans[best]
            shape = _describe(c, g)
            choice = Choice(c, t["compute"], t["sequential"], statistics.median(per[best]),
                            f"{shape}: {how}", g)
        else:  # the ones fast by their median that did not win enough rounds
            few = "".join(f"; {n} beat sequential in {wins[n]} of {self.rounds} rounds, fewer "
                          f"than {need}" for n in fast)
            choice = _fallback(self.key, self.comm, self.what, t,
                               f"no chunked schedule won its trial ({how}{few})")
        _CACHE[_full_key(self.comm, self.key)] = choice
