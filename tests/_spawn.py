"""Spawned runs shared by the distributed tests: a rank function runs once per world size,
its scenarios each become their own test, and a scenario that raises neither hides the
others nor re-runs the spawn."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from distllm.testing import DistributedFailure, run_distributed

__all__ = ["SpawnCache", "CaseError", "run_cases", "case_of"]


@dataclass
class CaseError:
    """What a scenario raised on a rank (its traceback), kept in place of its result."""

    text: str


def run_cases(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run every scenario (in every rank, in the same order); each one's result, or a
    :class:`CaseError` for those that raised."""
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            out[name] = CaseError(traceback.format_exc())
    return out


def case_of(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Scenario ``name``'s result on every rank; fails the test with the first rank's
    traceback if it raised there."""
    got = [r[name] for r in results]
    for rank, g in enumerate(got):
        if isinstance(g, CaseError):
            pytest.fail(f"rank {rank}, scenario {name!r} raised:\n{g.text}")
    return got


class SpawnCache:
    """``cache(fn, world)``: ``fn``'s per-rank results, ``fn`` run once per world size; a
    failed run is kept and raised by every test that needs it (not re-run)."""

    def __init__(self, timeout: float = 240) -> None:
        self.timeout, self.done = timeout, {}

    def __call__(self, fn: Callable[[], Any], world: int) -> list[Any]:
        key = (fn.__module__, fn.__name__, world)
        if key not in self.done:
            try:
                self.done[key] = run_distributed(fn, world, timeout=self.timeout)
            except DistributedFailure as e:
                self.done[key] = e
        if isinstance(self.done[key], Exception):
            raise self.done[key]
        return self.done[key]
