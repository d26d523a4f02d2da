"""Pipeline bubble and activations in flight, per schedule.

What a rank holds for memory is replayed from its schedule (:func:`memory_states`): the
micro-batches each local chunk holds and the messages sent so far, at every moment that can
be the peak.

When :mod:`distllm.parallel.pipeline` provides ``simulate`` (a replay of the real schedule),
the planner can use it for the short list of candidates; the closed forms below are used
for the full search and whenever the simulator is absent:

* GPipe and 1F1B: ``(m + p - 1) * (t_f + t_b)`` (bubble fraction ``(p-1)/(m+p-1)``,
  Huang et al. 2019; Narayanan et al. 2021 sec. 2.2).
* Interleaved 1F1B with v chunks per rank: the bubble shrinks by v, at v times the
  point-to-point messages (Narayanan et al. 2021 sec. 2.2.2).
* ZB-H1: backward split into B (input gradients) and W (weight gradients) with W filling the
  cool-down; bubble ``(p-1) * (t_f + t_b - 2 t_w)`` against 1F1B's ``(p-1) * (t_f + t_b)``
  (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 3, where their T_B excludes W).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from distllm.parallel.pipeline.schedules import SCHEDULES

__all__ = ["in_flight", "pipeline_time", "SCHEDULES", "simulator_or_none", "compute_order",
           "MemoryState", "memory_states", "pipeline_lower_bound"]


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[float]:
    """Micro-batches of a whole rank's activations held at peak, per pipeline rank.

    1F1B: rank ``r`` runs ``p - r`` forwards before its first backward frees one. ZB-H1
    holds a micro-batch from its forward until its weight-gradient pass (W), which the
    cool-down defers: every rank, the last included, holds up to ``p`` (the schedule's
    replay, :func:`distllm.parallel.pipeline.simulate`, counts the same). Between B and W
    only the deferred linears' inputs and output gradients stay, so counting a whole
    micro-batch there is an upper bound (:func:`memory_states` tells the two apart)."""
    if p == 1 or schedule == "none":
        return [1.0]
    if schedule == "gpipe":
        return [float(m)] * p
    if schedule == "interleaved-1f1b":
        # warm-up of rank r: 2(p-1-r) + (v-1)p chunk forwards (Megatron's interleaved 1F1B)
        return [min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v) / v for r in range(p)]
    if schedule == "zb-h1":
        return [float(min(p, m))] * p
    return [float(min(p - r, m)) for r in range(p)]  # 1f1b


ZB_H1_BUILT = 2
"""ZB-H1 orders of up to this many micro-batches per stage are built whole; longer ones repeat
the steady state's period (see :func:`compute_order`)."""


@functools.cache
def _built_orders(schedule: str, p: int, m: int, v: int) -> tuple[tuple, ...]:
    """Every rank's compute order, from ``build_schedule``."""
    from distllm.parallel.pipeline.schedules import build_schedule

    sched = build_schedule(schedule, p, m, v)
    return tuple(tuple((a.kind, a.mb, a.chunk) for a in sched.compute(r)) for r in range(p))


def clear_replays() -> None:
    """Drop the cached schedule replays (:func:`compute_order`, :func:`memory_states`): one
    search fills them (a large batch: up to a GB), and a training run that planned its
    layout (``--plan auto``) need not keep them."""
    for f in (_built_orders, compute_order, memory_states):
        f.cache_clear()


def _shifted(actions, d: int) -> tuple[tuple[str, int, int], ...]:
    return tuple((kind, mb + d, c) for kind, mb, c in actions)


@functools.cache
def compute_order(schedule: str, p: int, m: int, v: int, r: int
                  ) -> tuple[tuple[str, int, int], ...]:
    """Rank ``r``'s compute actions ``(kind, micro-batch, chunk)`` in the order the executor
    runs them (kind F, B or W).

    GPipe, 1F1B and interleaved 1F1B follow the orders of
    :mod:`distllm.parallel.pipeline.schedules`, built here for one rank (``build_schedule``
    builds every rank's list with its messages and checks it, seconds for 64 stages of 1536
    micro-batches). ZB-H1's list scheduling needs every rank: its orders come from
    ``build_schedule``, for more than ``ZB_H1_BUILT * p`` micro-batches by repeating the
    steady state's period (F, B and W of consecutive micro-batches every three actions) of
    the order built for that many."""
    if schedule == "gpipe":
        return tuple([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        order = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i, 0), ("B", i, 0)]
        return tuple(order + [("B", i, 0) for i in range(m - warm, m)])
    if schedule == "interleaved-1f1b":
        total = m * v

        def fwd(k: int) -> tuple[int, int]:
            group, rem = divmod(k, p * v)
            return group * p + rem % p, rem // p

        def bwd(k: int) -> tuple[str, int, int]:
            mb, c = fwd(k)
            return ("B", mb, v - 1 - c)

        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [("F", *fwd(k)) for k in range(warm)]
        for i in range(total - warm):
            order += [("F", *fwd(warm + i)), bwd(i)]
        return tuple(order + [bwd(k) for k in range(total - warm, total)])
    m0 = ZB_H1_BUILT * p
    if schedule != "zb-h1" or m <= m0:
        return _built_orders(schedule, p, m, v)[r]
    base = _built_orders(schedule, p, m0, v)[r]
    at = base.index(("F", m0 // 2, 0))  # inside the steady state
    period = base[at:at + 3]
    if base[at + 3:at + 6] != _shifted(period, 1):  # no period there: build it whole
        return _built_orders(schedule, p, m, v)[r]
    d = m - m0
    return (base[:at] + tuple(a for t in range(d) for a in _shifted(period, t))
            + _shifted(base[at:], d))


class MemoryState(NamedTuple):
    """What a pipeline rank holds at one moment of a step, in counts (see
    :func:`memory_states`)."""

    held: tuple[int, ...]
    """Micro-batches whose activations are held, per group of local chunks."""
    deferred: tuple[int, ...]
    """Micro-batches past B whose W has not run (zb-h1), per group of local chunks: only the
    deferred weight gradients' inputs (and the stage input) are held for them."""
    sent: int
    """Messages sent so far in the step (activations forward, input gradients backward)."""
    running: int
    """The group of the chunk whose backward (B or W) runs, or -1: just after a forward."""
    posted: int
    """Receive buffers posted ahead for the next compute action (0 or 1)."""
    grads: tuple[int, ...]
    """Local chunks, per group, whose gradient accumulation buffers are alive (with more
    than one micro-batch): from the end of the chunk's first backward (B) of the step, whose
    gradients make them as they land (``distllm.parallel.data.buckets``), to its last (W
    under zb-h1), which reduces and frees them."""


def _dominates(a: MemoryState, b: MemoryState) -> bool:
    """Every byte ``b`` counts, ``a`` counts too (all byte figures are non-negative)."""
    return (a != b and (b.running == -1 or a.running == b.running) and a.sent >= b.sent
            and a.posted >= b.posted
            and all(x >= y for x, y in zip(a.held, b.held, strict=True))
            and all(x >= y for x, y in zip(a.deferred, b.deferred, strict=True))
            and all(x >= y for x, y in zip(a.grads, b.grads, strict=True)))


def _between(a: MemoryState, b: MemoryState, c: MemoryState) -> bool:
    """``b`` lies on the segment from ``a`` to ``c`` (same running pass and posted receive):
    a sum of byte figures weighted by its counts is at most the larger of theirs."""
    if not (a.running == b.running == c.running and a.posted == b.posted == c.posted):
        return False
    u = [y - x for x, y in zip((*a.held, *a.deferred, *a.grads, a.sent),
                               (*b.held, *b.deferred, *b.grads, b.sent), strict=True)]
    w = [y - x for x, y in zip((*b.held, *b.deferred, *b.grads, b.sent),
                               (*c.held, *c.deferred, *c.grads, c.sent), strict=True)]
    parallel = all(u[i] * w[j] == u[j] * w[i] for i in range(len(u)) for j in range(i))
    return parallel and sum(x * y for x, y in zip(u, w, strict=True)) > 0


@functools.cache
def memory_states(schedule: str, p: int, m: int, v: int, r: int,
                  groups: tuple[int, ...] | None = None) -> tuple[MemoryState, ...]:
    """The moments of rank ``r``'s step at which its memory can peak, by replaying
    :func:`compute_order`: the end of every forward (its chunk's activations all held) and
    every backward pass (B and W: the chunk's activations still held, its gradients being
    made). A forward adds one micro-batch to its chunk; its backward removes it (in a
    schedule that splits the backward, B moves it to ``deferred``, and W removes it there).
    ``sent`` counts the forward outputs sent on (every stage but the last) and the input
    gradients sent back (every stage but the first); ``posted``, the receive for the next
    action, posted before this one runs.

    ``grads`` counts the chunks whose gradient accumulation buffers are alive: none before a
    chunk's first backward, so a forward-only peak (GPipe, or an interleaved warm-up with
    few micro-batches) holds none; without a pipeline, a forward after the first (``m > 1``)
    holds them.

    ``groups[c]``: the group of local chunk ``c`` (chunks of equal bytes share one; None:
    a group per chunk); ``held``, ``grads`` and ``running`` count by group. Of the moments
    with the same counts, running pass and posted receive only the last is kept (``sent``
    only grows); of those, none that another counts in full, nor any between two others of
    the same kind."""
    groups = tuple(range(v)) if groups is None else groups
    n = max(groups) + 1
    if p == 1 or schedule == "none":
        return (MemoryState((1,) * n, (0,) * n, 0, 0, 0, (int(m > 1),) * n),)
    order = compute_order(schedule, p, m, v, r)
    split = schedule == "zb-h1"  # B makes the input gradient, W the weight gradients
    stages = p * v
    stage = [c * p + r for c in range(v)]

    def needs_recv(a: tuple[str, int, int]) -> int:
        kind, _, c = a
        return int(kind == "F" and stage[c] > 0 or kind == "B" and stage[c] < stages - 1)

    held, deferred, sent = [0] * n, [0] * n, 0
    # B run and passes that land weight gradients (B, or W where it is split) run, per chunk
    begun, landed = [0] * v, [0] * v

    def grads() -> tuple[int, ...]:
        out = [0] * n
        for c in range(v):
            out[groups[c]] += begun[c] >= 1 and landed[c] < m
        return tuple(out)

    # (held, deferred, running, posted, grads): (position, sent)
    last: dict[tuple, tuple[int, int]] = {}
    for k, (kind, _mb, c) in enumerate(order):
        posted = needs_recv(order[k + 1]) if k + 1 < len(order) else 0
        g = groups[c]
        if kind == "F":
            held[g] += 1
            sent += stage[c] < stages - 1
            last[(tuple(held), tuple(deferred), -1, posted, grads())] = (k, sent)
        else:
            # a chunk's last backward reduces its buffers as it goes: counted whole there
            last[(tuple(held), tuple(deferred), g, posted, grads())] = (k, sent)
            if kind == "B":
                sent += stage[c] > 0
                held[g] -= 1
                deferred[g] += split
                begun[c] += 1
                landed[c] += not split
            else:  # W
                deferred[g] -= 1
                landed[c] += 1
    moments = sorted((k, MemoryState(h, d, sent, run, posted, gr))
                     for (h, d, run, posted, gr), (k, sent) in last.items())
    # a moment can only be counted in full by one with as many held and sent: one sorted
    # earlier (a backward before a forward that holds the same)
    kept: list[tuple[int, MemoryState]] = []
    for k, st in sorted(_inner(moments), reverse=True,
                        key=lambda e: (sum(e[1].held), sum(e[1].deferred), e[1].sent,
                                       e[1].posted, e[1].running)):
        if not any(_dominates(o, st) for _, o in kept):
            kept.append((k, st))
    return tuple(st for _, st in _inner(sorted(kept)))


def _inner(moments: list[tuple[int, MemoryState]]) -> list[tuple[int, MemoryState]]:
    """``(step position, moment)`` in step order, less each that lies between its neighbours
    left."""
    line: list[tuple[int, MemoryState]] = []
    for k, st in moments:
        while len(line) >= 2 and _between(line[-2][1], line[-1][1], st):
            line.pop()
        line.append((k, st))
    return line


def pipeline_time(
    schedule: str,
    p: int,
    m: int,
    v: int,
    t_f: list[float],
    t_b: list[float],
    t_w: list[float],
    t_comm: float,
    simulator: Callable | None = None,
) -> float:
    """Seconds of the forward+backward part of a step (all ranks done).

    ``t_f[r]``, ``t_b[r]``: forward and full backward (B + W) of one micro-batch through all
    of rank r's layers; ``t_w[r]``: the weight-gradient part of ``t_b[r]``; ``t_comm``: one
    point-to-point transfer. Uneven ranks: fill and drain pass every rank once, the steady
    state runs at the slowest one (exact for even ranks, the textbook forms above, with
    ``m >= p``: the search and the trainer ask that of every schedule but GPipe; below it
    the zb-h1 form is short, e.g. 10 against the simulator's 17 at p 8, m 1, F = B = W).
    """
    if p == 1 or schedule == "none":
        return m * (t_f[0] + t_b[0])
    if simulator is not None:
        got = simulator(schedule, p, m, v, t_f, t_b, t_w, t_comm)
        if got is not None:
            return got
    c = t_comm
    one = [f + b + 2 * c for f, b in zip(t_f, t_b, strict=True)]
    slow = max(one)
    if schedule in ("gpipe", "1f1b"):
        return (m - 1) * slow + sum(one)
    if schedule == "interleaved-1f1b":
        chunk = [f / v + b / v + 2 * c for f, b in zip(t_f, t_b, strict=True)]
        return m * v * max(chunk) + (sum(chunk) - max(chunk))
    if schedule == "zb-h1":
        idle = [max(f + b - 2 * w, f) + 2 * c for f, b, w in zip(t_f, t_b, t_w, strict=True)]
        return m * slow + (sum(idle) - idle[one.index(slow)])
    raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")


def pipeline_lower_bound(schedule: str, p: int, m: int, v: int, t_f: list[float],
                         t_b: list[float], t_comm: float) -> float:
    """A time that neither :func:`pipeline_time`'s closed forms nor the simulator's replay of
    the same case can beat (the search re-times with the simulator only the layouts that
    could win by it). Rank ``r`` runs its ``m`` micro-batches one action at a time
    (``m * (t_f[r] + t_b[r])``); its first forward waits for micro-batch 0 to pass the first
    chunk of every rank before it, one transfer each; and (GPipe, 1F1B, interleaved: a
    rank's last action is the backward of its first chunk) the last micro-batch's
    gradient then passes back through the same ranks. ZB-H1 may end a rank on a W: no drain there.
    Arguments as :func:`pipeline_time`'s (``t_b`` is B + W)."""
    if p == 1 or schedule == "none":
        return m * (t_f[0] + t_b[0])
    drain = schedule != "zb-h1"
    best, fill = 0.0, 0.0
    for r in range(p):
        best = max(best, m * (t_f[r] + t_b[r]) + fill)
        fill += t_f[r] / v + t_comm + (t_b[r] / v + t_comm if drain else 0.0)
    return best


SIM_MAX_ACTIONS = 4096  # larger cases use the closed form (the replay is pure Python)


def simulator_or_none() -> Callable | None:
    """An adapter to ``distllm.parallel.pipeline``'s schedule replay if it is importable.

    The adapter returns the simulated step time, or None when the simulator cannot run that
    case (too big, or a schedule it refuses), so that the closed form is used instead.
    """
    try:  # lazy: the pipeline package is a higher-level sibling and may be absent
        from distllm.parallel.pipeline.schedules import build_schedule
        from distllm.parallel.pipeline.simulate import simulate
    except Exception:  # noqa: BLE001 - absent or broken: closed forms
        return None

    def run(schedule, p, m, v, t_f, t_b, t_w, t_comm):
        if p * m * v > SIM_MAX_ACTIONS:
            return None
        try:
            sched = build_schedule(schedule, p, m, v if schedule == "interleaved-1f1b" else 1)
            # per chunk; a non-split backward B takes (t_b - t_w) + t_w in the simulator
            res = simulate(
                sched,
                [f / v for f in t_f],
                [(b - w) / v for b, w in zip(t_b, t_w, strict=True)],
                [w / v for w in t_w],
                t_comm,
            )
        except Exception:  # noqa: BLE001 - an unsupported case falls back to the formula
            return None
        if getattr(res, "deadlock", None):
            return None
        return float(res.step_time)

    return run
