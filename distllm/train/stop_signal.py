"""Stopping a run on a signal, with a checkpoint: what a preemptible job needs.

A cluster scheduler that takes a job's nodes back signals its processes first, and kills
them a grace period later: SLURM sends SIGTERM at a time limit or on ``scancel`` (and a
chosen signal ahead of the limit with ``--signal=USR1@SECONDS``), Kubernetes sends SIGTERM
when it evicts a pod. Training that dies there loses every step since its last checkpoint.

While the steps run, :class:`StopSignal` turns each signal of ``--save-on-signal``
(SIGTERM and SIGUSR1 by default) into a request: the handler only sets a flag, so the step
in flight finishes as it would have. The ranks then agree, so that they stop after the same
step, however many of them were signalled: after each step every rank starts an all-reduce
(MAX) of its flag over the world, and reads the result after the next step, so the agreement
costs no wait in the step (the collective runs while the next step does). The flag is a CPU
tensor on a gloo group of its own, so a CUDA stream never waits for it, and the group is
destroyed when the steps end: gloo's worker threads release a finished collective's tensor
a moment after its wait returns, and one that does so while the interpreter shuts down
aborts the process ("terminate called without an active exception"); in a world the caller
started and does not destroy before it exits, the flag's last exchange could be that one.

The run then saves a checkpoint (unless that step was just saved) and ends without the
final validation, with exit code 128 + the signal; ``--resume`` continues it. A request
therefore stops the run one or two steps after it arrives, plus a checkpoint save: the
scheduler's grace period must cover that.

Before the steps (building the model, loading a checkpoint) the process's previous handlers
are in place, so a signal there acts as it did before. The checkpoint and validation of a
step, the last one's included, run with the steps' handlers: a signal during the last step's
save or validation is a request like any other, and the run, at its end, finishes them and
ends as a finished run (exit code 0).
"""

from __future__ import annotations

import datetime
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["StopSignal", "SIGNALS", "parse_signals"]

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
"""The signals ``--save-on-signal`` may name (SIGINT stays Ctrl-C's immediate stop)."""


def parse_signals(spec: str) -> tuple[str, ...]:
    """``"SIGTERM,SIGUSR1"`` (names with or without ``SIG``, any case) as canonical names;
    ``"none"`` (or ``""``) as none. Raises ValueError naming ``--save-on-signal``."""
    if spec.strip().lower() in ("", "none"):
        return ()
    out: list[str] = []
    for part in spec.split(","):
        name = part.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in SIGNALS or not hasattr(signal, name):
            have = ", ".join(s for s in SIGNALS if hasattr(signal, s))
            raise ValueError(f"--save-on-signal {spec}: {part.strip()!r} is not one of "
                             f"{have}; name them comma-separated, or none")
        if name not in out:
            out.append(name)
    return tuple(out)


class StopSignal:
    """The run's stop request: a context manager installing the handlers for ``names`` (in
    the main thread; elsewhere a process cannot take signals, and none is installed), and
    :meth:`poll` / :meth:`settle`, the ranks' agreement on it over the world. Every rank must
    make it, call them and leave it at the same points, as the collectives they are (making
    it makes a gloo group of the world's ranks, leaving it without an error destroys it)."""

    def __init__(self, names: tuple[str, ...], timeout: datetime.timedelta | None = None):
        self.names = names
        self.received = 0  # the signal number this rank received (the highest), 0: none
        self._previous: dict[int, object] = {}
        self._pending: dist.Work | None = None
        # the flag travels as a CPU tensor over a gloo group of the world's ranks made here
        # (no device stream waits for it), read through a numpy view (no tensor read)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if names else None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._read = self._flag.numpy()

    def _handle(self, signum: int, frame) -> None:  # only a flag: the step runs on
        self.received = max(self.received, signum)

    def __enter__(self) -> StopSignal:
        if self.names and threading.current_thread() is threading.main_thread():
            for name in self.names:
                num = getattr(signal, name)
                self._previous[num] = signal.signal(num, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous.clear()
        if exc_type is None:  # nothing in flight after the steps (after a failure, a peer
            self._finish()  # may never join it, and the group stays as it is)
            if self.group is not None:  # its threads end here, with what they held
                dist.destroy_process_group(self.group)
                self.group = None
        self._pending = None

    def _start(self) -> None:
        self._flag.fill_(self.received)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)

    def _finish(self) -> int:
        if self._pending is None:
            return 0
        work, self._pending = self._pending, None
        work.wait()
        return int(self._read[0])

    def poll(self) -> str | None:
        """After a step: the name of the signal the ranks agreed on (the highest any rank
        received before its previous poll), or None; then this rank's flag goes out for the
        next poll. Without installed handlers (``names`` empty) nothing is exchanged."""
        if not self.names:
            return None
        agreed = self._finish()
        self._start()
        return signal.Signals(agreed).name if agreed else None

    def settle(self) -> str | None:
        """After the last step: the agreement on everything received so far (the flag in
        flight and this rank's flag now), waiting for it."""
        if not self.names:
            return None
        agreed = self._finish()
        self._start()
        agreed = max(agreed, self._finish())
        return signal.Signals(agreed).name if agreed else None
