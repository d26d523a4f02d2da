"""Fixtures of the device-discipline tests: a fake CUDA job on this CPU-only machine (see
``_fakecuda``): every collective must receive CUDA tensors only, and a CPU tensor meeting a
CUDA one raises as it would on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.device._fakecuda import Host, Recorder, fake_cuda, no_cuda_runtime
from tests.train._util import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture
def cuda_job(monkeypatch):
    """``(recorder, host)`` with fake CUDA tensors active and the CUDA runtime stubbed; the
    test starts its own fake world (``fake_world``) to choose the world size."""
    with no_cuda_runtime(monkeypatch), Recorder().installed() as rec, \
            Host().installed() as host, fake_cuda(), warnings.catch_warnings():
        # a bucket compares data pointers to tell a grad view from a new tensor; fake
        # tensors have none (the comparison only decides a copy, not where tensors live)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield rec, host


@pytest.fixture(autouse=True)
def _fresh_autotune_cache():
    from distllm.parallel.tensor import overlap_tuner

    overlap_tuner.clear_cache()
    yield
    overlap_tuner.clear_cache()


@pytest.fixture(autouse=True)
def _no_grad_mode_leak():
    prev = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(prev)
