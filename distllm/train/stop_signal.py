"""Stopping a run on a signal, with a checkpoint: what a preemptible job needs.

A cluster scheduler that takes a job's nodes back signals its processes first, and kills
them a grace period later: SLURM sends SIGTERM at a time limit or on ``scancel`` (and a
chosen signal ahead of the limit with ``--signal=USR1@SECONDS``), Kubernetes sends SIGTERM
when it evicts a pod. Training that dies there loses every step since its last checkpoint.

While the steps run, :class:`StopSignal` turns each signal of ``--save-on-signal``
(SIGTERM and SIGUSR1 by default) into a request: the handler only sets a flag, so the step
in flight finishes as it would have. The ranks then agree, so that they stop after the same
step, however many of them were signalled: after each step every rank starts an all-reduce
(MAX) of its flag on the world group, and reads the result after the next step, so the
agreement costs no wait in the step (the collective runs while the next step does). The run
then saves a checkpoint and ends without validation; ``--resume`` continues it. A request
therefore stops the run one or two steps after it arrives, plus a checkpoint save: the
scheduler's grace period must cover that.

Outside the steps (building the model, loading a checkpoint, the final save, validation)
the process's previous handlers are in place, so a signal there acts as it did before.
"""

from __future__ import annotations

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
    :meth:`poll` / :meth:`settle`, the ranks' agreement on it. Every rank must call them at
    the same points, as the collectives they are."""

    def __init__(self, names: tuple[str, ...], group: dist.ProcessGroup | None = None):
        from distllm.comm.collectives import group_device

        self.names = names
        self.group = group
        self.device = group_device(group) if names else torch.device("cpu")
        self.received = 0  # the signal number this rank received (the highest), 0: none
        self._previous: dict[int, object] = {}
        self._pending: dist.Work | torch.cuda.Event | None = None
        # one flag for the run, read through a numpy view of host memory (no tensor read in
        # a step): on CUDA a pinned copy of the device flag, else the flag itself
        self._flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else self._flag
        self._read = self._host.numpy()

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
            self._finish()  # may never join it)
        self._pending = None

    def _start(self) -> None:
        self._flag.fill_(self.received)
        work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group,
                               async_op=True)
        if self._host is not self._flag:
            # read back without syncing the stream at the next poll (which would wait for the
            # step queued since): the stream waits for the all-reduce and copies the flag to
            # pinned memory; the next poll waits for this point of the stream only
            work.wait()
            self._host.copy_(self._flag, non_blocking=True)
            work = torch.cuda.Event()
            work.record()
        self._pending = work

    def _finish(self) -> int:
        if self._pending is None:
            return 0
        handle, self._pending = self._pending, None
        if isinstance(handle, torch.cuda.Event):
            handle.synchronize()
        else:
            handle.wait()
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
