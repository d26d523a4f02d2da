"""``distllm train --nproc N``'s launcher, and what its ranks share with it.

The launcher runs torch's elastic agent in this process, as ``torchrun --standalone`` would;
the ranks leave their one-line messages (bad input, a timed-out collective, a signal they
stopped on) in a folder the launcher names (:data:`USAGE_ERRORS_ENV`), and it prints each
distinct one once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from distllm.cli import UsageError

__all__ = ["launch", "check_nproc", "end_with_launcher", "report_failure", "cores",
           "first_line", "timed_out", "lost_peer", "USAGE_ERRORS_ENV", "LAUNCHER_PID_ENV",
           "STOPPED_FILE", "TIMEOUT_PREFIX", "LOST_PREFIX"]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


STOPPED_FILE = "stopped-by-signal.txt"
"""Written into :data:`USAGE_ERRORS_ENV`'s folder by a rank that stopped on a signal of
``--save-on-signal`` (after its checkpoint): the signal's name."""

LAUNCHER_PID_ENV = "DISTLLM_TRAIN_LAUNCHER_PID"
"""Set by ``--nproc``'s launcher for its ranks: its process id. A rank ends with it
(:func:`end_with_launcher`), also when it is killed with SIGKILL, which it cannot pass on."""

TIMEOUT_PREFIX = "timeout-rank"
"""A rank whose collective timed out writes ``timeout-rank<R>.txt`` into
:data:`USAGE_ERRORS_ENV`'s folder: one line, which the launcher prints instead of its
traceback."""

LOST_PREFIX = "lost-rank"
"""A rank whose collective lost its connection to another rank (that rank died: its own exit
is the cause the launcher names) writes ``lost-rank<R>.txt`` into :data:`USAGE_ERRORS_ENV`'s
folder instead of printing gloo's traceback."""

USAGE_ERRORS_ENV = "DISTLLM_TRAIN_USAGE_ERRORS"
"""Set by ``--nproc``'s launcher for its ranks: a folder into which a rank writes its bad-input
message (``rank<R>.txt``) instead of printing it; the launcher prints each distinct one once.
Ranks of any other launcher print theirs."""


@contextlib.contextmanager
def launcher_scope():
    """Restores what launching changes in this process: the environment, the signal handlers
    torch's elastic agent installs; and keeps its log records (of a failed rank, of the
    ranks it stops) off stderr unless ``LOGLEVEL`` (the agent's own knob) is set."""
    env = dict(os.environ)
    sigs = [s for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
            if hasattr(signal, s)]
    handlers = {s: signal.getsignal(getattr(signal, s)) for s in sigs}
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic",
                                              "torch.distributed.launcher")]
    quiet = logging.NullHandler()
    saved = [lg.propagate for lg in loggers]
    if "LOGLEVEL" not in os.environ:
        for lg in loggers:
            lg.addHandler(quiet)
            lg.propagate = False
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for s, h in handlers.items():
            signal.signal(getattr(signal, s), h)
        for lg, prop in zip(loggers, saved, strict=True):
            lg.removeHandler(quiet)
            lg.propagate = prop


def launch(nproc: int, argv: list[str], timeout_s: float) -> int:
    """Run ``distllm train argv`` on ``nproc`` ranks of this machine, as ``torchrun
    --standalone`` does (torch's elastic agent in this process, a c10d rendezvous on a free
    port, no restarts). Bad input a rank finds is printed once (exit code 2); another failure
    names the first failed rank (exit code 1). A signal stops the ranks: the agent passes it on
    (the signals of ``--save-on-signal`` too, which then save a checkpoint) and waits
    ``timeout_s`` seconds (``--timeout``) for them (30 s on torch without
    ``shutdown_timeout``) before it kills them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from distllm.comm.compat import elastic_launch_config, elastic_signal_handler

    # the agent's own default, and the user signals (the ranks of --save-on-signal save on
    # them; without, their default action ends the ranks as it would have ended the
    # launcher, which must not die of them alone and leave the ranks training)
    passed_on = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    passed_on += [s for s in ("SIGUSR1", "SIGUSR2") if hasattr(signal, s)]

    with tempfile.TemporaryDirectory(prefix="distllm-train-") as tmp, launcher_scope():
        errors = os.path.join(tmp, "usage-errors")
        os.mkdir(errors)
        os.environ[USAGE_ERRORS_ENV] = errors
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // nproc)))
        config = elastic_launch_config(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
            monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
            signals_to_handle=",".join(passed_on),
            shutdown_timeout=math.ceil(timeout_s))
        before, killed = set(_children()), []

        def wrap(handler):  # torch's: raises SignalException, then the agent stops the ranks
            def on_signal(signum, frame):
                if not killed:
                    killed.append(False)
                    print(f"distllm train: stopping the ranks (waiting up to {timeout_s:g} s, "
                          f"--timeout, for them to save and end); signal again to kill them "
                          f"now", file=sys.stderr, flush=True)
                    handler(signum, frame)
                elif not killed[-1]:  # again: the agent is waiting for the ranks
                    killed.append(_kill_ranks_left(before))
            return on_signal

        try:
            with elastic_signal_handler(wrap):
                elastic_launch(config, sys.executable)("-m", "distllm", "train", *argv)
        except ChildFailedError as exc:
            return report_failure(exc, Path(errors), nproc)
        except SignalException as exc:
            _close_rendezvous(exc)
            killed.append(_kill_ranks_left(before))  # (what the agent might have left)
            print(f"distllm train: stopped by {exc.sigval.name}"
                  + ("; the ranks still running were killed" if any(killed) else ""),
                  file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


def _children(running: bool = False) -> list[int]:
    """The processes whose parent is this one (Linux's /proc; none elsewhere); ``running``:
    not those that have ended (zombies, not yet reaped)."""
    me, kids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == me and not (running and state == "Z"):
                kids.append(int(stat.parent.name))
    return kids


def _kill_ranks_left(before: set[int]) -> bool:
    """SIGKILL the ranks (children started since ``before``) still running, each with its
    process group; whether there were any. The agent stops its ranks on the first signal,
    waiting up to ``--timeout`` for them; a second signal (Ctrl-C again) interrupted that
    wait and began another, and a third ended the launcher with its ranks running (a
    stalled one until its collective timed out, or for good). The agent reaps them."""
    left = [pid for pid in _children(running=True) if pid not in before]
    for pid in left:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:  # (each rank leads its own group: its workers too)
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    return bool(left)


def _close_rendezvous(exc: BaseException) -> None:
    """Shut down the rendezvous handler of the agent a signal stopped (``exc``'s traceback
    holds it). torch leaves it open on a signal, for the other nodes of an elastic job; this
    job has one node and a fresh run id. Left open, its keep-alive thread runs on, and when
    that thread happens to hold the last reference as the handler is dropped, the timer's
    finalizer runs in that thread, fails to join it, and prints a traceback after the
    launcher's last line."""
    tb = exc.__traceback__
    while tb is not None:
        spec = tb.tb_frame.f_locals.get("spec")
        handler = getattr(spec, "rdzv_handler", None)
        if handler is not None:
            with contextlib.suppress(Exception):  # cleanup only: the job has already stopped
                handler.shutdown()
            return
        tb = tb.tb_next


def report_failure(exc, errors: Path, nproc: int) -> int:
    """One line per distinct bad-input message the ranks left in ``errors`` (exit code 2);
    else, where ranks timed out in a collective, one line naming them and the ranks that
    did not answer; else one line naming the first failed rank of ``exc`` (a
    ``ChildFailedError``)."""
    if (stopped := errors / STOPPED_FILE).is_file():  # the ranks stopped on a signal, saved
        name = stopped.read_text().strip()
        print(f"distllm train: stopped by {name}", file=sys.stderr)
        return 128 + int(getattr(signal, name))
    messages: list[str] = []
    for f in sorted(errors.glob("rank*.txt"), key=lambda f: int(f.stem.removeprefix("rank"))):
        msg = f.read_text().strip()
        if msg and msg not in messages:
            messages.append(msg)
    for msg in messages:
        print(f"distllm train: error: {msg}", file=sys.stderr)
    if messages:
        return 2
    timed_out = sorted(int(f.stem.removeprefix(TIMEOUT_PREFIX))
                       for f in errors.glob(f"{TIMEOUT_PREFIX}*.txt"))
    lost = sorted(int(f.stem.removeprefix(LOST_PREFIX)) for f in errors.glob(f"{LOST_PREFIX}*.txt"))
    crashed = [r for r, f in exc.failures.items()
               if r not in timed_out and r not in lost and f.exitcode > 0]
    if timed_out and not crashed:  # (a rank that failed on its own is the one to name)
        first = (errors / f"{TIMEOUT_PREFIX}{timed_out[0]}.txt").read_text().strip()
        silent = [r for r in range(nproc) if r not in timed_out]
        print(f"distllm train: error: rank {timed_out[0]} {first}"
              + (f"; ranks {silent} did not answer (stalled, or died)" if silent else ""),
              file=sys.stderr)
        return 1
    # the cause: the first rank that failed other than by losing a peer
    causes = {r: f for r, f in exc.failures.items() if r not in lost}
    if not causes:  # every failed rank lost a peer: the network, or a rank that left quietly
        first = (errors / f"{LOST_PREFIX}{lost[0]}.txt").read_text().strip()
        print(f"distllm train: error: rank {lost[0]} lost its connection to another rank "
              f"({first}): a rank died, or the network between them failed", file=sys.stderr)
        return 1
    rank, failure = min(causes.items(), key=lambda rf: rf[1].timestamp)
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"failed (exit code {failure.exitcode}); its traceback is above"
    print(f"distllm train: error: rank {rank} {what}", file=sys.stderr)
    return 1


def check_nproc(nproc: int) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise UsageError("--nproc starts torchrun itself: drop it under an external torchrun")
    if nproc < 1 or nproc > cores() * 4:
        raise UsageError(f"--nproc {nproc}: this machine has {cores()} cores; choose "
                         f"1..{cores() * 4} ranks")
    import torch

    # on a GPU machine each rank trains on a GPU of its own (NCCL refuses two on one)
    if torch.cuda.is_available() and nproc > (gpus := torch.cuda.device_count()):
        raise UsageError(f"--nproc {nproc}: this machine shows {gpus} GPUs, one per rank; "
                         f"choose 1..{gpus} ranks (CUDA_VISIBLE_DEVICES limits the GPUs shown)")


def end_with_launcher() -> None:
    """Under ``--nproc``'s launcher (its pid in :data:`LAUNCHER_PID_ENV`): have Linux send this
    rank SIGTERM when the launcher dies (``prctl(PR_SET_PDEATHSIG)``), so that a launcher
    killed with SIGKILL (or by the OOM killer) does not leave its ranks training and writing
    into ``--out``; SIGTERM then stops them as a scheduler's would (with a checkpoint under
    ``--save-on-signal``). Elsewhere, or on another OS, nothing."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def first_line(exc: BaseException) -> str:
    """The error's first line without the C++ source location gloo prefixes (``[file:N]``)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line)[:160]


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's lost connection to another rank (gloo's "Connection
    reset by peer" / "Connection closed by peer" when that rank's process died; NCCL's
    ``ncclRemoteError``, "... a remote process exiting prematurely")."""
    text = str(exc).lower()
    return any(w in text for w in ("connection reset by peer", "connection closed by peer",
                                   "broken pipe", "ncclremoteerror"))


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's timeout (gloo's "Timed out waiting ... ms"; NCCL's
    watchdog: "Watchdog caught collective operation timeout: ... before timing out", which
    reaches Python where the watchdog does not end the process itself)."""
    text = str(exc).lower()
    return "timed out" in text or "collective operation timeout" in text
