"""``overlap_grad_reduce="auto"``: whether the gradient all-reduce runs during backward or
after it, decided by a trial in the training step.

Overlapping the reduction of each gradient bucket with the rest of backward pays where the
collective has time of its own to hide: a GPU's NCCL kernels beside the compute stream, wire
time on a slow link. On a CPU rank with one core on loopback the collective's time is the
core's own (gloo's copies, the kernel's TCP stack), so the overlap only shares that core
with backward, and the reduction after backward can be the faster step: on a 2-core Zen 5,
distllm DDP's step of a 19.7M-parameter model ran at 0.906 of the overlapped step's time
without the overlap on loopback and level with it over an emulated 10 Gbit/s link
(``bench/results/cpu-zen5-20261204``).

So on CPU, in all-reduce mode (DDP, ZeRO-0/1, whose buckets live for the whole step either
way), ``"auto"`` times the step's synchronised backward both ways: after one untimed cycle,
:data:`ROUNDS` rounds of two cycles, one with each schedule in an order that alternates from
round to round, each cycle timed from its first synchronised gradient to the end of
``finish`` (backward, the reduction, and its wait). One all-reduce over the group of those
times (MAX over the ranks: a step ends with its slowest rank) decides, the same on every
rank: the reduction after backward is kept when the median over the rounds of its time over
the overlapped one's in the same round is below ``1 - MARGIN`` and it was the faster in at
least :data:`WIN_SHARE` of the rounds; otherwise the overlap stays. The decision is logged
once through ``logging.getLogger("distllm")``.

Elsewhere ``"auto"`` is the overlap: on CUDA (the collective runs beside the compute and a
host clock cannot time the step without a synchronisation) and in reduce-scatter mode
(ZeRO-2/3 free each bucket once its reduction completes; reduced after backward, the whole
gradient would be held at its end). Both schedules give bit-identical gradients (the same
division on the way in, the same collectives on the same buffers), so the trial changes
nothing but time.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence

import torch

__all__ = ["MARGIN", "ROUNDS", "WIN_SHARE", "ReductionTrial", "reduction_schedule", "trial_cycles"]

log = logging.getLogger("distllm")

ROUNDS = 6  # rounds of two synchronised cycles (one each way)
MARGIN = 0.03  # the reduction after backward must beat the overlap by this
WIN_SHARE = 0.75  # ... and be the faster in this share of the rounds


def trial_cycles(rounds: int | None = None) -> int:
    """Synchronised cycles (steps) a trial of ``rounds`` rounds (default :data:`ROUNDS`)
    takes: one untimed, then two per round."""
    return 1 + 2 * (ROUNDS if rounds is None else rounds)


class ReductionTrial:
    """The trial of one reducer (see the module docstring). :meth:`overlap_now` says how the
    next synchronised cycle runs; :meth:`record` takes its time (ms) once it ran so, and at
    the trial's last cycle decides with ``max_over_ranks(values) -> values`` (collective
    over the group: every rank records the same number of cycles)."""

    def __init__(self, what: str, max_over_ranks: Callable[[Sequence[float]], list[float]],
                 rounds: int = ROUNDS) -> None:
        if rounds < 1:
            raise ValueError(f"rounds={rounds}: a trial needs at least one round")
        self.what, self.rounds, self._max = what, rounds, max_over_ranks
        self.cycles = 0  # synchronised cycles recorded, the untimed first one included
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.decision: bool | None = None  # True: overlap, False: after backward
        self.reason = f"trial in the step: {trial_cycles(rounds)} synchronised steps"

    @property
    def done(self) -> bool:
        return self.decision is not None

    def overlap_now(self) -> bool:
        """How the next synchronised cycle reduces (``True``: overlapped)."""
        if self.decision is not None:
            return self.decision
        k = self.cycles - 1  # the timed cycle it will be (-1: the untimed first)
        if k < 0:
            return True
        rnd, pos = divmod(k, 2)
        first = rnd % 2 == 0  # rounds alternate which schedule goes first
        return first if pos == 0 else not first

    def record(self, ms: float) -> None:
        """The time of the cycle just finished, run as :meth:`overlap_now` said; decides
        after the last one."""
        if self.decision is not None:
            return
        if self.cycles > 0:
            self.samples[self.overlap_now()].append(ms)
        self.cycles += 1
        if self.cycles == trial_cycles(self.rounds):
            self._decide()

    def _decide(self) -> None:
        vals = self._max([*self.samples[True], *self.samples[False]])  # R each
        on, off = vals[:self.rounds], vals[self.rounds:]
        ratio = statistics.median(b / a for a, b in zip(on, off, strict=True))
        wins = sum(b < a for a, b in zip(on, off, strict=True))
        need = math.ceil(WIN_SHARE * self.rounds)
        how = (f"{ratio:.3f} of the overlapped ones' time, median of {self.rounds} rounds; "
               f"faster in {wins} of {self.rounds}")
        after = ratio < 1 - MARGIN and wins >= need
        self.decision = not after
        if after:
            self.reason = f"after backward (its steps took {how})"
        else:
            self.reason = (f"during backward (the steps reduced after it took {how}; keeping "
                           f"them needs < {1 - MARGIN:.2f} and {need} of {self.rounds})")
        log.info("%s: the gradient reduction runs %s", self.what, self.reason)


def reduction_schedule(overlap: bool | str, *, mode: str, nranks: int, device: torch.device,
                       what: str, max_over_ranks: Callable[[Sequence[float]], list[float]]
                       ) -> tuple[ReductionTrial | None, bool, str]:
    """How a reducer of ``nranks`` ranks in ``mode`` (``"all_reduce"`` or
    ``"reduce_scatter"``) on ``device`` reduces for ``overlap_grad_reduce=overlap``: its trial
    (under ``"auto"`` where one runs, else ``None``), whether its first cycle overlaps
    backward, and why (see the module docstring)."""
    if overlap not in (True, False, "auto"):
        raise ValueError(f"overlap_grad_reduce={overlap!r}: use True, False or 'auto'")
    if overlap != "auto":
        return None, bool(overlap), "during backward" if overlap else "after backward"
    if mode != "all_reduce":
        return None, True, ("during backward: reduce-scatter mode frees each bucket once "
                            "reduced (after backward the whole gradient would be held)")
    if nranks == 1:
        return None, True, "nothing to reduce (one rank)"
    if device.type != "cpu":
        return None, True, (f"during backward: on {device.type} the collective runs beside "
                            "the compute")
    trial = ReductionTrial(what, max_over_ranks)
    return trial, trial.overlap_now(), "during backward"
