"""Pipeline schedules as data: one list of actions per pipeline rank.

An :class:`Action` is ``(kind, mb, chunk)``:

- ``F``: forward of micro-batch ``mb`` through local model chunk ``chunk``;
- ``B``: its backward. In a schedule with ``split_backward`` (zero-bubble) ``B`` computes the
  input gradient only, and ``W`` computes the weight gradients later; otherwise ``B`` does both;
- ``W``: the deferred weight-gradient pass (split schedules only);
- ``SEND_F`` / ``RECV_F``: post the send of ``F``'s output to the next stage / post the receive
  of ``F``'s input from the previous stage;
- ``SEND_B`` / ``RECV_B``: post the send of ``B``'s input gradient to the previous stage / post
  the receive of the gradient of the chunk's output from the next stage.

Communication actions only *post* a transfer (asynchronous ``isend`` / ``irecv``); a compute
action waits for its input when it starts. Consecutive communication actions form one batch
(``batch_isend_irecv``). The lists are built from a compute order per rank by
:func:`with_comms`: each send right after its producer, each receive posted one compute
action ahead of its consumer (so the transfer overlaps the compute before it), which makes
the batch between two computes ``[sends of the previous, receives for the next ones]`` (the
send-forward/receive-backward pairing of 1F1B). ``simulate`` checks any schedule for
deadlocks before it runs.

Stage ``s`` lives on rank ``s % pp`` as chunk ``s // pp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Action", "Schedule", "SCHEDULES", "build_schedule", "check_args",
           "forward_only_schedule", "with_comms", "validate"]

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class Action(NamedTuple):
    kind: str
    mb: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}({self.mb},{self.chunk})"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one training step (``actions[pp_rank]``)."""

    name: str
    pp: int
    micro_batches: int
    virtual_stages: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(repr, self.compute(r)))
                         for r in range(self.pp))


def check_args(name: str, pp: int, m: int, v: int) -> None:
    """A ValueError naming the knob when :func:`build_schedule` cannot build ``name`` for
    ``pp`` ranks, ``m`` micro-batches and ``v`` chunks per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown: choose one of {list(SCHEDULES)}")
    for knob, val in (("pp", pp), ("micro_batches", m), ("virtual_stages", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{knob}={val!r}: it must be a positive integer")
    if v > 1 and name != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved-1f1b'; "
                         f"{name!r} runs one model chunk per rank (virtual_stages=1)")
    if name == "interleaved-1f1b" and pp > 1 and v < 2:
        raise ValueError(
            f"interleaved-1f1b with virtual_stages={v}: interleaving needs at least 2 model "
            f"chunks per rank (with one it is 1F1B holding up to twice the activations); "
            f"raise --virtual-stages to >= 2, or use schedule '1f1b'")
    if name == "interleaved-1f1b" and m % pp:
        ok = [pp * k for k in range(1, 5)]
        raise ValueError(
            f"interleaved-1f1b needs --micro-batches to be a multiple of pp={pp} "
            f"(got {m}): choose --micro-batches in {ok}..., or use schedule '1f1b'"
        )


def _gpipe(pp: int, m: int) -> list[list[Action]]:
    return [[Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]
            for _ in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order = [Action(F, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action(F, warm + i), Action(B, i)]
        order += [Action(B, i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of ``pp``."""
    total = m * v

    def fwd(k: int) -> tuple[int, int]:
        group, rem = divmod(k, pp * v)
        return group * pp + rem % pp, rem // pp  # (mb, chunk)

    orders = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = [Action(F, *fwd(k)) for k in range(warm)]
        for i in range(total - warm):
            mb, c = fwd(i)
            order += [Action(F, *fwd(warm + i)), Action(B, mb, v - 1 - c)]
        for k in range(total - warm, total):
            mb, c = fwd(k)
            order.append(Action(B, mb, v - 1 - c))
        orders.append(order)
    return orders


def _zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 by list scheduling in unit time (F = B = W = 1), one decision per rank per tick.

    Rank ``r`` prefers F while fewer than ``pp - r`` micro-batches sit between their F and B
    (1F1B's warm-up depth), else B first (the critical path), then F, then a pending W
    (filling what would be a bubble). A micro-batch's activations are held from F to W, at
    most ``pp`` at once on every rank: 1F1B's peak (that of its rank 0). With ``m >= pp`` the
    bubble is a third of 1F1B's, as in the zero-bubble paper's ZB-H1.
    """
    f_done = [[-1] * m for _ in range(pp)]  # tick in which F(mb) ran on rank r
    b_done = [[-1] * m for _ in range(pp)]
    nf, nb, nw = [0] * pp, [0] * pp, [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    t = 0
    while any(nw[r] < m for r in range(pp)):
        for r in range(pp):  # decisions at tick t see only results of ticks < t
            i, j = nb[r], nf[r]
            grad_in = (f_done[r][i] if r == pp - 1 else b_done[r + 1][i]) if i < m else -1
            act_in = (0 if r == 0 else f_done[r - 1][j]) if j < m else -1
            ready = {
                B: i < nf[r] and 0 <= grad_in < t,
                F: j < m and nf[r] - nw[r] < pp and (r == 0 or 0 <= act_in < t),
                W: nw[r] < nb[r],
            }
            prio = (F, B, W) if nf[r] - nb[r] < pp - r else (B, F, W)
            kind = next((k for k in prio if ready[k]), None)
            if kind == B:
                b_done[r][i], nb[r] = t, i + 1
                orders[r].append(Action(B, i))
            elif kind == F:
                f_done[r][j], nf[r] = t, j + 1
                orders[r].append(Action(F, j))
            elif kind == W:
                orders[r].append(Action(W, nw[r]))
                nw[r] += 1
        t += 1
    return orders


def _needs(a: Action, rank: int, pp: int, stages: int) -> Action | None:
    """The receive action a compute action consumes, if any."""
    s = a.chunk * pp + rank
    if a.kind == F and s > 0:
        return Action(RECV_F, a.mb, a.chunk)
    if a.kind == B and s < stages - 1:
        return Action(RECV_B, a.mb, a.chunk)
    return None


def _makes(a: Action, rank: int, pp: int, stages: int) -> Action | None:
    s = a.chunk * pp + rank
    if a.kind == F and s < stages - 1:
        return Action(SEND_F, a.mb, a.chunk)
    if a.kind == B and s > 0:
        return Action(SEND_B, a.mb, a.chunk)
    return None


def with_comms(orders: list[list[Action]], pp: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Insert the send/receive actions into per-rank compute orders (see the module doc)."""
    stages = pp * v
    out = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        posted: set[Action] = set()
        for k, a in enumerate(order):
            for nxt in order[k:k + 2]:  # this action's input, and the next one's, ahead
                need = _needs(nxt, r, pp, stages)
                if need is not None and need not in posted:
                    posted.add(need)
                    acts.append(need)
            acts.append(a)
            made = _makes(a, r, pp, stages)
            if made is not None:
                acts.append(made)
        out.append(tuple(acts))
    return tuple(out)


def build_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for ``pp`` ranks and ``micro_batches``.

    ``gpipe``: all forwards, then all backwards (holds ``m`` micro-batches' activations).
    ``1f1b``: ``pp - r - 1`` warm-up forwards on rank ``r``, then one forward one backward.
    ``interleaved-1f1b``: ``virtual_stages`` chunks per rank; needs ``m % pp == 0``.
    ``zb-h1``: backward split into B (input grad) and W (weight grad), W's deferred into
    what would be bubbles; at most ``pp`` micro-batches' activations per rank (1F1B's peak).
    """
    check_args(name, pp, micro_batches, virtual_stages)
    m, v = micro_batches, virtual_stages
    if name == "gpipe":
        orders = _gpipe(pp, m)
    elif name == "1f1b":
        orders = _one_f_one_b(pp, m)
    elif name == "interleaved-1f1b":
        orders = _interleaved(pp, m, v)
    else:
        orders = _zb_h1(pp, m)
    sched = Schedule(name, pp, m, v, name == "zb-h1", with_comms(orders, pp, v))
    validate(sched)
    return sched


def forward_only_schedule(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Forwards only (evaluation): every rank runs ``F`` of each micro-batch through its
    chunks in stage order."""
    m, v = micro_batches, virtual_stages
    orders = [[Action(F, i, c) for c in range(v) for i in range(m)] for _ in range(pp)]
    return Schedule("forward", pp, m, v, False, with_comms(orders, pp, v))


def validate(s: Schedule) -> None:
    """Check per-rank lists: each compute action exactly once, F < B < W per (mb, chunk),
    each receive posted before its consumer and each send after its producer."""
    stages = s.num_stages
    kinds = (F, B, W) if s.split_backward else (F, B)
    for r, acts in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(acts)}
        if len(pos) != len(acts):
            raise AssertionError(f"rank {r}: an action appears twice")
        for c in range(s.virtual_stages):
            for mb in range(s.micro_batches):
                seq = [pos.get(Action(k, mb, c), -1) for k in kinds]
                if min(seq) < 0 or seq != sorted(seq):
                    raise AssertionError(f"rank {r}: {kinds} of ({mb},{c}) missing or out of order")
                for a in (Action(F, mb, c), Action(B, mb, c)):
                    need, made = _needs(a, r, s.pp, stages), _makes(a, r, s.pp, stages)
                    if need is not None and not pos.get(need, 1 << 30) < pos[a]:
                        raise AssertionError(f"rank {r}: {need} not posted before {a}")
                    if made is not None and not pos.get(made, -1) > pos[a]:
                        raise AssertionError(f"rank {r}: {made} not after {a}")
