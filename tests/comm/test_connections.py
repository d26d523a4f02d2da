"""The CUDA_DEVICE_MAX_CONNECTIONS advice of the overlap engines, with the GPU's compute
capability and the environment injected (no GPU needed): warned once per process on
compute capability >= 9.0 unless the variable is 1, never below 9.0, and never set by the
library."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from distllm.comm import connections
from distllm.comm.connections import VARIABLE, max_connections_advice, warn_max_connections


@pytest.fixture(autouse=True)
def _fresh():
    connections.reset()
    yield
    connections.reset()


@pytest.mark.parametrize(
    "cap,env,warns",
    [
        ((9, 0), {}, True),  # Hopper, unset (CUDA's default: 8 connections)
        ((9, 0), {VARIABLE: "8"}, True),
        ((10, 0), {VARIABLE: "32"}, True),  # newer than Hopper
        ((9, 0), {VARIABLE: "1"}, False),
        ((9, 0), {VARIABLE: " 1 "}, False),
        ((8, 0), {}, False),  # Ampere: not asked for
        ((8, 9), {VARIABLE: "8"}, False),
    ],
)
def test_advice(cap, env, warns):
    msg = max_connections_advice(cap, env)
    assert (msg is not None) == warns
    if warns:
        assert f"{VARIABLE}=1" in msg and f"{cap[0]}.{cap[1]}" in msg
        assert (repr(env[VARIABLE]) if VARIABLE in env else "unset") in msg


def test_warns_once_per_process(caplog):
    env_before = dict(os.environ)
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with caplog.at_level(logging.WARNING, logger="distllm"):
        assert warn_max_connections(dev0, capability=(9, 0), environ={})
        assert not warn_max_connections(dev0, capability=(9, 0), environ={})
        assert not warn_max_connections(dev1, capability=(9, 0), environ={})
    msgs = [r.getMessage() for r in caplog.records if VARIABLE in r.getMessage()]
    assert len(msgs) == 1
    assert dict(os.environ) == env_before  # advice only: the library sets no variable


def test_no_warning_when_set_or_older_gpu(caplog):
    with caplog.at_level(logging.WARNING, logger="distllm"):
        assert not warn_max_connections(torch.device("cuda", 0), (9, 0), {VARIABLE: "1"})
        assert not warn_max_connections(torch.device("cuda", 1), (8, 0), {})
    assert not [r for r in caplog.records if VARIABLE in r.getMessage()]


def test_engine_cuda_path_asks_for_the_advice(monkeypatch):
    # the overlap engine's CUDA launch consults the advice before it issues anything
    from distllm.parallel.tensor import overlap

    class Asked(Exception):
        pass

    def asked(device):
        raise Asked(device)

    monkeypatch.setattr(overlap, "warn_max_connections", asked)

    class _CudaTensor:  # what launch reads of a CUDA output before the advice
        is_cuda = True
        device = torch.device("cuda", 0)

    comm = overlap.CommContext.__new__(overlap.CommContext)  # no process group needed
    comm.trace = None
    with pytest.raises(Asked, match="cuda:0"):
        comm.launch("all_reduce", _CudaTensor())
