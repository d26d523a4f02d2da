"""``StopSignal``: a signal becomes a request the ranks agree on one poll later, and the
signals ``--save-on-signal`` may name. Its use by the trainer (every rank stops after the
same step with a checkpoint, and the run resumes from it exactly) is tested in
``test_checkpoint``; under ``--nproc``'s launcher in ``test_cli``."""

from __future__ import annotations

import os
import signal

import pytest

from distllm.testing import run_distributed
from distllm.train.stop_signal import StopSignal, parse_signals


def polls_around_a_signal(signalled_rank: int, own_group: bool) -> tuple[list, str, bool]:
    """Rank function: four polls; ``signalled_rank`` sends itself SIGUSR1 after the first.
    Also the handler in place inside the block and the previous one after it. ``own_group``:
    the world is taken for one without a CPU backend (NCCL's), so a gloo group is made."""
    import torch.distributed as dist

    from distllm.train import stop_signal

    if own_group:
        stop_signal.backend_for = lambda group, device_type: None
    before = signal.getsignal(signal.SIGUSR1)
    got = []
    with StopSignal(("SIGUSR1",)) as stop:
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
        got.append(stop.poll())
        if dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        got.append(stop.poll())  # the flags sent at the first poll: none yet
        got.append(stop.poll())  # those sent at the second: this rank's, or a peer's
        got.append(stop.settle())
    assert signal.getsignal(signal.SIGUSR1) == before
    return got, dist.get_backend(stop.group), stop.group is None


@pytest.mark.parametrize("own_group", [False, True], ids=["world", "own-gloo-group"])
def test_every_rank_agrees_one_poll_later(own_group):
    for got, backend, world in run_distributed(polls_around_a_signal, 2, 1, own_group):
        assert backend == "gloo" and world != own_group
        assert got == [None, None, "SIGUSR1", "SIGUSR1"]


def test_without_signals_nothing_is_installed_or_exchanged():
    """Here, outside any process group, a collective would raise."""
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal(()) as stop:
        assert signal.getsignal(signal.SIGTERM) == before
        assert stop.poll() is None and stop.settle() is None


@pytest.mark.parametrize("spec,names", [
    ("SIGTERM,SIGUSR1", ("SIGTERM", "SIGUSR1")),
    ("term, usr2,TERM", ("SIGTERM", "SIGUSR2")),
    ("none", ()), ("", ()),
])
def test_parse_signals(spec, names):
    assert parse_signals(spec) == names


@pytest.mark.parametrize("spec", ["SIGINT", "SIGKILL", "TERM,HUP", "15"])
def test_parse_signals_refuses_what_it_cannot_stop_on(spec):
    with pytest.raises(ValueError, match=r"--save-on-signal .* is not one of SIGTERM, SIGUSR1, "
                                         r"SIGUSR2; name them comma-separated, or none"):
        parse_signals(spec)
