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


@pytest.mark.parametrize("bad", [0, -1.0, "static"])
def test_bad_loss_scale(bad):
    with pytest.raises(ValueError, match=f"loss_scale={bad!r}: use None, a positive number"):
        LossScaler(bad)
