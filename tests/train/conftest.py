"""Fixtures of the training tests: one small corpus and the single-process reference run."""

from __future__ import annotations

import pytest

from distllm.testing import run_distributed
from tests.train._util import train_many, write_corpus

REF_STEPS = 60  # the learning-rate schedule's length in every test; runs stop early


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture(scope="session")
def references(corpus, tmp_path_factory) -> dict:
    """The single-process run (tp1.pp1.dp1, float64, the default optimizer settings) of a
    60-step schedule stopped after 6 steps: its per-step losses under ``wd``, and under
    ``weights3`` its weights after 3 steps (``{layer: {name: tensor}}``, from its checkpoint
    of step 3), which the parity tests' runs of 3 steps end with, and under ``weights6``
    after 6 (the resumed runs' end)."""
    from pathlib import Path

    from distllm.train.checkpoint import read_layers

    out = str(tmp_path_factory.mktemp("ref"))
    runs = [dict(steps=REF_STEPS, stop_after=6, save_every=3, save_final=True)]
    res = run_distributed(train_many, 1, runs, corpus, out, timeout=300)[0]
    ckpts = Path(out) / "run0" / "checkpoints"
    return {"wd": res[0], "weights3": read_layers(ckpts / "step_00000003")[1],
            "weights6": read_layers(ckpts / "step_00000006")[1]}


@pytest.fixture(scope="session")
def reference(references) -> list[float]:
    return references["wd"]


@pytest.fixture(scope="session")
def reference_weights(references) -> dict:
    return references["weights3"]
