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


def polls_around_a_signal(signalled_rank: int) -> tuple[list, str, bool]:
    """Rank function: four polls; ``signalled_rank`` sends itself SIGUSR1 after the first.
    Also the handler in place inside the block and the previous one after it, the flag's
    group inside it (gloo, not the world's), and whether that group is gone after it."""
    import torch.distributed as dist

    before = signal.getsignal(signal.SIGUSR1)
    got = []
    with StopSignal(("SIGUSR1",)) as stop:
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
        group = stop.group
        backend = dist.get_backend(group)
        got.append(stop.poll())
        if dist.get_rank() == signalled_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        got.append(stop.poll())  # the flags sent at the first poll: none yet
        got.append(stop.poll())  # those sent at the second: this rank's, or a peer's
        got.append(stop.settle())
    assert signal.getsignal(signal.SIGUSR1) == before
    return got, backend, _destroyed(group) and stop.group is None


def _destroyed(group) -> bool:
    import torch.distributed as dist

    try:
        dist.get_backend(group)
    except ValueError:  # torch: "... is not initialized in the world group map"
        return True
    return False


def test_every_rank_agrees_one_poll_later():
    """Over a gloo group of the flag's own, destroyed when the block ends: gloo's threads
    release a collective's tensor after its wait, and one doing that in a world left alive
    at the interpreter's exit aborts the process (a given world, in ``test_trainer_world``)."""
    for got, backend, destroyed in run_distributed(polls_around_a_signal, 2, 1):
        assert backend == "gloo" and destroyed
        assert got == [None, None, "SIGUSR1", "SIGUSR1"]


def failing_block() -> tuple[bool, bool]:
    """Rank function: a block that raises leaves the flag's group as it is (a peer may be
    inside a collective on it), and the handler restored."""
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RuntimeError, match="a step failed"):
        with StopSignal(("SIGUSR1",)) as stop:
            group = stop.group
            stop.poll()
            raise RuntimeError("a step failed")
    return _destroyed(group), signal.getsignal(signal.SIGUSR1) == before


def test_a_failed_block_leaves_its_group():
    assert run_distributed(failing_block, 2) == [(False, True)] * 2


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
