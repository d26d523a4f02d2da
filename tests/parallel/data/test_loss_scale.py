"""The loss scaler alone: off, constant, and dynamic (halve on an overflow, never below 1,
double after a run of good steps), and the error that names the knob."""

from __future__ import annotations

import pytest
import torch

from distllm.parallel.data.loss_scale import DYNAMIC_INIT, GROWTH_INTERVAL, LossScaler


def test_off_and_constant():
    loss = torch.tensor(3.0)
    off = LossScaler(None)
    assert off.scale == 1.0 and off.scale_loss(loss) is loss  # no extra op when off
    const = LossScaler(8)
    assert const.scale_loss(loss).item() == 24.0
    const.update(skipped=True)
    assert const.scale == 8.0  # a constant scale never moves


def test_dynamic_halves_on_overflow_and_grows_after_good_steps():
    s = LossScaler("dynamic")
    assert s.scale == DYNAMIC_INIT == 2.0**16
    s.update(skipped=True)
    assert s.scale == 2.0**15
    for _ in range(GROWTH_INTERVAL - 1):
        s.update(skipped=False)
    assert s.scale == 2.0**15  # one good step short of the interval
    s.update(skipped=False)
    assert s.scale == 2.0**16
    s.update(skipped=False)
    s.update(skipped=True)  # an overflow restarts the count of good steps
    for _ in range(GROWTH_INTERVAL - 1):
        s.update(skipped=False)
    assert s.scale == 2.0**15
    for _ in range(40):
        s.update(skipped=True)
    assert s.scale == 1.0  # never below 1


@pytest.mark.parametrize("bad", [0, -1.0, "static", float("inf"), float("nan")])
def test_bad_loss_scale(bad):
    with pytest.raises(ValueError, match=f"loss_scale={bad!r}: use None, a finite positive number"):
        LossScaler(bad)


def test_state_round_trip_keeps_the_growth_schedule():
    s = LossScaler("dynamic")
    s.update(skipped=True)
    for _ in range(GROWTH_INTERVAL - 2):
        s.update(skipped=False)
    state = s.state_dict()
    assert state == {"dynamic": True, "scale": 2.0**15, "good_steps": GROWTH_INTERVAL - 2}
    resumed = LossScaler("dynamic")
    resumed.load_state_dict(state)
    for t in (s, resumed):
        t.update(skipped=False)
    assert resumed.scale == s.scale == 2.0**15  # one good step short, in both
    for t in (s, resumed):
        t.update(skipped=False)
    assert resumed.scale == s.scale == 2.0**16  # the interval ends at the same step


def test_load_state_keeps_a_constant_or_absent_scale():
    state = LossScaler("dynamic").state_dict()
    for setting, want in ((None, 1.0), (8.0, 8.0)):
        s = LossScaler(setting)
        s.load_state_dict(state)
        assert s.scale == want and s.state_dict()["good_steps"] == 0, setting
    dyn = LossScaler("dynamic")
    dyn.load_state_dict(LossScaler(8.0).state_dict())  # a constant's scale is not state
    assert dyn.scale == DYNAMIC_INIT
    old = LossScaler("dynamic")
    old.load_state_dict({"scale": 1024.0})  # saved without the count of good steps
    assert old.scale == 1024.0 and old.state_dict()["good_steps"] == 0
