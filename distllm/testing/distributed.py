"""Run a function on N gloo ranks, for tests and benchmarks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, each with
``torch.distributed`` initialised on gloo through a file rendezvous, calls
``fn(*args)`` (or ``fn(rank, *args)`` with ``pass_rank=True``) and returns the per-rank
results in rank order. A rank that raises, dies or overruns ``timeout`` ends the whole run:
every other rank is killed (no process is left behind) and the failing rank's traceback
is in the raised :class:`DistributedFailure`.

``fn`` must be importable by name (a module-level function), since ranks are started
from a fork server that has only imported torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_distributed", "DistributedFailure"]


class DistributedFailure(AssertionError):
    """A rank failed, died or timed out; the message carries its traceback."""


class _RendezvousFailure(DistributedFailure):
    """Gloo's TCP full mesh did not form (a peer's connection closed while the ranks
    connected, seen on 2 loaded cores): when the ranks started, before ``fn`` ran, or when
    ``fn`` created a process group (a mesh of its own), with no other error first."""


_RENDEZVOUS_RACE = "Gloo connectFullMesh failed"
_STARTS = 2  # a run whose ranks could not connect starts again once, from a fresh rendezvous


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                     "torch.distributed.checkpoint", "distllm"])
    return _CTX


def _rank_main(
    fn, rank, world, init_file, args, kwargs, results, threads, setup, pass_rank, env, timeout
):
    try:
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        try:
            if setup is not None:
                setup(rank, world)
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout),
            )
        except RuntimeError as e:
            if _RENDEZVOUS_RACE in str(e):  # before fn ran: the run may start again
                results.put((rank, "rendezvous", traceback.format_exc()))
                return
            raise
        try:
            out = fn(rank, *args, **kwargs) if pass_rank else fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - report before peers see the group close
            results.put((rank, "error", traceback.format_exc()))
            return
        if dist.is_initialized():
            # A rank whose fn ran no collective could otherwise close its group while a
            # peer is still forming gloo's connections to it ("Connection closed by peer")
            results.put((rank, "returned", None))
            try:
                dist.barrier()
            except BaseException:  # noqa: BLE001 - a peer's failure seen here: reported last
                results.put((rank, "error", _AT_END + traceback.format_exc()))
                return
        # by value: the queue's own pickler would send a tensor's storage as a file
        # descriptor that the parent fetches from this process later, which may have exited
        results.put((rank, "ok", pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
        if dist.is_initialized():  # (fn may have destroyed it)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, "error", traceback.format_exc()))


_AT_END = "(fn returned; waiting for the other ranks at the end, this rank got:)\n"

# Errors a rank gets because a peer went away: reported after the peer's own error.
_SECONDARY = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket closed",
    "Timed out waiting",
    "timed out",
)


def _order(errors: dict[int, str]) -> list[int]:
    """The failed ranks, the root cause first: an error of the rank's own, then gloo's mesh
    not forming (it names the peer that closed), then a peer's connection error."""

    def rank(r: int) -> tuple[int, int]:
        if errors[r].startswith(_AT_END):  # its fn returned: a peer's failure, surely
            return (3, r)
        if _RENDEZVOUS_RACE in errors[r]:
            return (1, r)
        return (2 if any(m in errors[r] for m in _SECONDARY) else 0, r)

    return sorted(errors, key=rank)


def _failure(name: str, world_size: int, errors: dict[int, str]) -> DistributedFailure:
    """One report with the root-cause rank first (not a peer's connection error); a
    :class:`_RendezvousFailure` where that is gloo's full mesh not forming when ``fn``
    created a process group (the run may start again)."""
    order = _order(errors)
    first = order[0]
    msg = f"{name}: rank {first} of {world_size} failed:\n{errors[first]}"
    others = [r for r in order[1:]]
    if others:
        msg += (
            f"\n(ranks {others} failed after it; first lines: "
            + "; ".join(f"rank {r}: {errors[r].strip().splitlines()[-1][:200]}" for r in others)
            + ")"
        )
    return (_RendezvousFailure if _RENDEZVOUS_RACE in errors[first] else DistributedFailure)(msg)


def _died(proc) -> str:
    """How a rank that sent nothing ended: its exit code (a signal by name)."""
    code = proc.exitcode
    if code == 0:
        return "exited (code 0) without returning its result (os._exit, or an exit hook)"
    how = f"exit code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-code).name})"
    return (f"died with {how} and no traceback (killed by a signal, a crash in native code, "
            "or os._exit)")


def _drain_errors(results, errors: dict[int, str], grace: float) -> None:
    """Collect the errors that arrive within ``grace`` seconds of the first one."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, kind, payload = results.get(timeout=max(0.05, end - time.monotonic()))
        except queue.Empty:
            return
        if kind == "error":
            errors[rank] = payload


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    threads: int = 1,
    setup: Callable[[int, int], None] | None = None,
    pass_rank: bool = False,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks and return their results in rank order.

    Args:
        timeout: seconds for the whole run; also the collective timeout of each rank.
        threads: ``torch.set_num_threads`` in each rank.
        setup: ``setup(rank, world)`` runs in the rank before the process group starts
            (e.g. to enter a network namespace).
        env: extra environment variables for the ranks.

    A run whose ranks cannot form gloo's connections (``connectFullMesh`` failed, before
    ``fn`` ran or in a process group it created, as the first error) starts again once from
    a fresh rendezvous, ``fn`` from its start; a second such failure is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: it must be at least 1")
    run = (fn, world_size, args, kwargs, timeout, threads, setup, pass_rank, env)
    for _ in range(_STARTS - 1):
        try:
            return _run_once(*run)
        except _RendezvousFailure:
            pass
    return _run_once(*run)


def _run_once(fn, world_size, args, kwargs, timeout, threads, setup, pass_rank, env):
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="distllm-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    r,
                    world_size,
                    init_file,
                    args,
                    kwargs,
                    results,
                    threads,
                    setup,
                    pass_rank,
                    dict(env or {}),
                    timeout,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, getattr(fn, "__name__", str(fn)))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _collect(procs, results, world_size, timeout, name) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    returned: set[int] = set()  # fn returned; the rank waits for the others at the end
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(out) - returned)
            waiting = sorted(returned - set(out))
            raise DistributedFailure(
                f"{name}: timed out after {timeout:.0f}s; ranks {missing} never finished "
                "(a hang in a collective, or a rank waiting on a message never sent)"
                + (f"; ranks {waiting} returned and waited for them" if waiting else "")
            )
        try:
            rank, kind, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            # (a rank that exits 0 without its result, os._exit(0), is dead too: it never
            # sends one, and waiting for it would end as a "hang" at the deadline)
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if dead:
                # give its queued traceback, if any, a moment to arrive
                try:
                    rank, kind, payload = results.get(timeout=2.0)
                except queue.Empty:
                    r = dead[0]
                    raise DistributedFailure(f"{name}: rank {r} {_died(procs[r])}") from None
            else:
                continue
        if kind == "returned":
            returned.add(rank)
            continue
        if kind == "rendezvous":
            raise _RendezvousFailure(f"{name}: rank {rank} could not connect:\n{payload}")
        if kind == "error":
            errors = {rank: payload}
            _drain_errors(results, errors, grace=1.0)
            # a rank that died without a word (a segfault in native code, the OOM killer) is
            # the cause its peers' connection errors point to: name it
            for r, p in enumerate(procs):
                if r not in errors and r not in out and p.exitcode not in (None, 0):
                    errors[r] = _died(p)
            raise _failure(name, world_size, errors)
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]
