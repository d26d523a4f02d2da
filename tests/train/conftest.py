"""Fixtures of the training tests: one small corpus and the single-process reference run."""

from __future__ import annotations

import pytest

from distllm.testing import run_distributed
from tests.train._util import train_many, write_corpus

REF_STEPS = 6


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory) -> list[float]:
    """Per-step losses of the single-process run (tp1.pp1.dp1, float64), 6 steps."""
    out = str(tmp_path_factory.mktemp("ref"))
    return run_distributed(train_many, 1, [dict(steps=REF_STEPS)], corpus, out, timeout=300)[0][0]
