"""Replay a :class:`Schedule` without running it: step time, bubbles, memory, deadlocks.

The model of execution is the executor's: each rank runs its action list in order; a send or
receive only posts a transfer and costs the rank nothing; a transfer completes ``t_comm``
after both its send and its receive are posted; a compute action starts when the rank is free
and its input has arrived. A rank whose next compute waits for a message that is never sent
(its sender is itself blocked, or never sends it) is a deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from distllm.parallel.pipeline.schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
)

__all__ = ["SimResult", "simulate", "message_of"]

Times = float | Sequence[float]


@dataclass
class SimResult:
    """What :func:`simulate` found.

    ``bubble[r]`` is rank ``r``'s idle time over the step time; ``peak_activations[r]`` the
    most micro-batches whose activations rank ``r`` held at once, in units of one
    micro-batch through all of the rank's layers (a chunk counts ``1/virtual_stages``);
    ``deadlock`` lists the blocked ``rank: action`` (empty when the schedule completes);
    ``fifo_ok`` says every pair of ranks posts its receives in the order of the matching sends
    (what NCCL, which matches point-to-point messages in order, needs).
    """

    step_time: float
    bubble: list[float]
    busy: list[float]
    peak_activations: list[float]
    deadlock: list[str] = field(default_factory=list)
    fifo_ok: bool = True
    timeline: list[list[tuple[Action, float, float]]] = field(default_factory=list)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def message_of(a: Action, rank: int, pp: int) -> tuple[tuple[str, int, int], int]:
    """``(key, peer rank)`` of a send/receive action; the key names the destination stage."""
    s = a.chunk * pp + rank
    dst = {SEND_F: s + 1, RECV_F: s, SEND_B: s - 1, RECV_B: s}[a.kind]
    peer_stage = {SEND_F: s + 1, RECV_F: s - 1, SEND_B: s - 1, RECV_B: s + 1}[a.kind]
    kind = "F" if a.kind in (SEND_F, RECV_F) else "B"
    return (kind, a.mb, dst), peer_stage % pp


def _per_rank(t: Times, pp: int, name: str) -> list[float]:
    if isinstance(t, int | float):
        return [float(t)] * pp
    t = [float(x) for x in t]
    if len(t) != pp:
        raise ValueError(f"{name} has {len(t)} entries: give one number or one per rank ({pp})")
    return t


def _input_key(a: Action, rank: int, pp: int, stages: int) -> tuple | None:
    s = a.chunk * pp + rank
    if a.kind == "F" and s > 0:
        return ("F", a.mb, s)
    if a.kind == "B" and s < stages - 1:
        return ("B", a.mb, s)
    return None


def simulate(schedule: Schedule, t_f: Times = 1.0, t_b: Times = 1.0, t_w: Times = 1.0,
             t_comm: float = 0.0) -> SimResult:
    """Replay ``schedule`` with per-action durations (one number, or one per rank).

    ``t_f``, ``t_b``, ``t_w`` are the times of one action: one micro-batch through one chunk.
    Without a split backward, ``B`` takes ``t_b + t_w``.
    """
    p, stages, v = schedule.pp, schedule.num_stages, schedule.virtual_stages
    tf, tb, tw = (_per_rank(t, p, n) for t, n in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    dur = {r: {"F": tf[r], "B": tb[r] if schedule.split_backward else tb[r] + tw[r], "W": tw[r]}
           for r in range(p)}
    free_kind = "W" if schedule.split_backward else "B"
    clock, ptr, busy = [0.0] * p, [0] * p, [0.0] * p
    held, peak = [0] * p, [0] * p
    done: list[set[Action]] = [set() for _ in range(p)]
    sent: dict[tuple, float] = {}
    posted: dict[tuple, float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = schedule.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.kind in COMPUTE:
                    key = _input_key(a, r, p, stages)
                    if key is not None and (key not in sent or key not in posted):
                        break
                    before = {"B": "F", "W": "B"}.get(a.kind)
                    if before and Action(before, a.mb, a.chunk) not in done[r]:
                        break  # its own F (or B) comes later on this rank: never runs
                    done[r].add(a)
                    ready = max(sent[key], posted[key]) + t_comm if key else 0.0
                    start = max(clock[r], ready)
                    clock[r] = start + dur[r][a.kind]
                    busy[r] += dur[r][a.kind]
                    timeline[r].append((a, start, clock[r]))
                    if a.kind == "F":
                        held[r] += 1
                        peak[r] = max(peak[r], held[r])
                    elif a.kind == free_kind:
                        held[r] -= 1
                else:
                    key, _ = message_of(a, r, p)
                    (sent if a.kind in (SEND_F, SEND_B) else posted)[key] = clock[r]
                ptr[r] += 1
                progress = True
    deadlock = [f"rank {r}: {schedule.actions[r][ptr[r]]}" for r in range(p)
                if ptr[r] < len(schedule.actions[r])]
    step = max(clock) if clock else 0.0
    return SimResult(
        step_time=step,
        bubble=[1.0 - b / step if step > 0 else 0.0 for b in busy],
        busy=busy,
        peak_activations=[k / v for k in peak],
        deadlock=deadlock,
        fifo_ok=_fifo_ok(schedule),
        timeline=timeline,
    )


def _fifo_ok(schedule: Schedule) -> bool:
    p = schedule.pp
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind in COMPUTE:
                continue
            key, peer = message_of(a, r, p)
            if a.kind in (SEND_F, SEND_B):
                sends.setdefault((r, peer), []).append(key)
            else:
                recvs.setdefault((peer, r), []).append(key)
    return sends == recvs
