"""The interval algebra of the step timeline: merged intervals, their intersection, and the
hidden share of a timeline's communication."""

from __future__ import annotations

import pytest

from distllm.diagnostics.timeline import hidden, merge, overlap_ms


def test_timeline_interval_algebra():
    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap_ms([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    tl = [{"lane": "comm", "name": "ar", "start_ms": 1.0, "end_ms": 3.0},
          {"lane": "comm", "name": "ar", "start_ms": 2.0, "end_ms": 4.0},
          {"lane": "compute", "name": "mm", "start_ms": 0.0, "end_ms": 2.5}]
    assert hidden(tl) == (pytest.approx(3.0), pytest.approx(1.5))
