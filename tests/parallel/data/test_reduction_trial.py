"""``overlap_grad_reduce="auto"``'s trial, from synthetic cycle times: the order it runs the
two schedules in, the rule that keeps the reduction after backward (a margin and a share of
rounds won, on the MAX over the ranks), and that it decides once."""

from __future__ import annotations

import logging

import pytest

from distllm.parallel.data import reduction_trial
from distllm.parallel.data.reduction_trial import ReductionTrial, trial_cycles


def _run(times_on, times_off, max_fn=None, rounds=4):
    """A trial of ``rounds`` rounds fed ``times_on[r]`` / ``times_off[r]`` for round ``r``;
    the schedule of every cycle, and the trial."""
    t = ReductionTrial("test", max_fn or (lambda v: list(v)), rounds=rounds)
    ran, k = [], {True: 0, False: 0}
    for _ in range(trial_cycles(rounds) + 2):
        ov = t.overlap_now()
        ran.append(ov)
        if len(ran) == 1:
            t.record(1e6)  # the untimed first cycle: its time is not used
            continue
        src = times_on if ov else times_off
        t.record(src[k[ov]] if k[ov] < len(src) else 0.0)
        k[ov] += 1
    return ran, t


def test_rounds_alternate_which_schedule_runs_first():
    ran, t = _run([10.0] * 4, [10.0] * 4)
    # untimed first (overlapped), then rounds (on, off), (off, on), ...; then the decision
    assert ran[:9] == [True, True, False, False, True, True, False, False, True], ran
    assert t.done and ran[9:] == [t.decision] * 2


def test_after_backward_kept_when_faster_by_the_margin_in_enough_rounds(caplog):
    with caplog.at_level(logging.INFO, logger="distllm"):
        _, t = _run([10.0, 10.0, 10.0, 10.0], [9.0, 9.5, 9.0, 10.5])  # ratios .9 .95 .9 1.05
    assert t.decision is False, t.reason
    assert t.reason == ("after backward (its steps took 0.925 of the overlapped ones' time, "
                        "median of 4 rounds; faster in 3 of 4)"), t.reason
    said = [r.getMessage() for r in caplog.records if "gradient reduction" in r.getMessage()]
    assert len(said) == 1 and "after backward" in said[0], said


@pytest.mark.parametrize("off, why", [
    ([9.8, 9.8, 9.8, 9.8], "within the margin"),  # faster every round, by 2%
    ([5.0, 5.0, 11.0, 11.0], "too few rounds won"),  # median 0.8, but 2 of 4 rounds
    ([12.0, 11.0, 12.0, 11.0], "slower"),
])
def test_the_overlap_stays_otherwise(off, why):
    _, t = _run([10.0] * 4, off)
    assert t.decision is True, (why, t.reason)
    assert t.reason.startswith("during backward (the steps reduced after it took "), t.reason
    assert t.reason.endswith("keeping them needs < 0.97 and 3 of 4)"), t.reason


def test_the_decision_takes_the_slowest_rank():
    # this rank saw the reduction after backward at 0.8, the other rank (the MAX) at 1.1
    other = [10.0] * 4 + [11.0] * 4

    def max_fn(vals):
        return [max(a, b) for a, b in zip(vals, other, strict=True)]

    _, t = _run([10.0] * 4, [8.0] * 4, max_fn=max_fn)
    assert t.decision is True and "1.100" in t.reason, t.reason


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds"):
        ReductionTrial("test", list, rounds=0)


def test_the_default_trial_length():
    assert trial_cycles() == 1 + 2 * reduction_trial.ROUNDS
