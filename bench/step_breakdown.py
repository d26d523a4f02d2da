"""Per-step breakdown of a training step from ``torch.profiler``: what a step dispatches,
so that two implementations of the same step (distllm and its torch peer) can be compared
count by count, and a regression shows where it came from.

:func:`breakdown` profiles one call of a step function and returns a flat dict. The call
runs inside a ``bench::step`` profiler range (:data:`STEP_RANGE`); the operator counts are
of the operators on the step's thread within that range, so what runs after the step under
the profiler (``drain``) is not counted:

- ``wall_ms``: the profiled step's wall time (the profiler slows the host: compare counts,
  and times only within one profile);
- ``ops``: top-level operators (``aten::``, ``mkldnn::``, ``c10d::``, ``distllm::``, ...:
  :data:`OP_PREFIXES`; an operator called by another one is not counted again), and
  ``op_ms`` their total time;
- ``outside_ms``: ``wall_ms - op_ms``, the time spent outside any operator (Python,
  autograd bookkeeping, hooks, the optimizer's loop);
- ``collectives`` / ``collective_mb``: collective and point-to-point calls (``c10d::``)
  and the bytes of their tensors, with ``by_collective`` (name -> calls) and
  ``by_transfer_mb`` (the backend's transfer -> MiB); a send and its receive count each, so
  the 2-rank exchange all-reduce counts twice its tensor where gloo's all-reduce counts it
  once (the bytes each rank sends are the same); the backend's transfers are counted from
  the step's start to the end of the profile, since what the step left in flight completes
  while ``drain`` waits for it;
- ``copies``: tensor copies at any depth (``copy_``, which ``clone``, ``_to_copy`` and
  ``contiguous`` end in, ``cat``, ``_foreach_copy_``);
- ``allocs`` / ``alloc_mb``: operators that allocated memory for themselves (the
  profiler's self memory of an operator, net of what it freed, when positive) and the bytes;
- ``syncs``: host reads of a tensor, one per read: ``item()``, ``float(t)``, ``int(t)`` and
  ``bool(t)`` dispatch ``aten::_local_scalar_dense`` (or ``aten::item`` where none shows),
  counted there; ``tolist()`` dispatches no such operator, so its calls on the step's thread
  are counted by wrapping ``torch.Tensor.tolist`` during the step (restored after it);
- ``top``: the ten operators with the largest total time, ``[name, calls, ms]``.

The counts are per call of the step function, on the calling rank.

:func:`cpu_split` runs a step without the profiler and says where this process's CPU time
went (Linux, from ``/proc/self/task/*/schedstat``): ``main_cpu_ms`` on the calling thread
(which also runs a CPU backward), ``main_wait_ms`` the time it was runnable but waiting for
a core (what other threads and processes took from it), and ``threads_cpu_ms``, the other
threads by name (gloo's transport and work threads: the CPU a step's communication costs
on a machine whose cores also compute). Medians over a few calls; a step that leaves work
in flight is measured as a step of a loop.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["breakdown", "cpu_split", "thread_times", "OP_PREFIXES", "COPY_OPS", "SYNC_OPS",
           "STEP_RANGE", "compare_breakdowns"]

# the namespaces of the operators a step dispatches: torch's (aten, the oneDNN kernels that
# torch's CPU linear and distllm's cpu backend call as ``mkldnn::``, the functional
# collectives), c10d's collectives and distllm's own
OP_PREFIXES = ("aten::", "mkldnn::", "c10d::", "_c10d_functional::", "c10d_functional::",
               "prims::", "distllm::")
# every copy ends in one of these (clone, _to_copy and contiguous call copy_)
COPY_OPS = frozenset({"aten::copy_", "aten::cat", "aten::_foreach_copy_"})
SYNC_OPS = frozenset({"aten::_local_scalar_dense"})
_SYNC_FALLBACK = frozenset({"aten::item"})  # when no _local_scalar_dense shows
STEP_RANGE = "bench::step"  # the profiler range around the profiled call of the step


def _is_op(name: str) -> bool:
    return name.startswith(OP_PREFIXES)


def _top_level(events) -> list:
    """Operator events none of whose ancestors is an operator."""
    out = []
    for e in events:
        if not _is_op(e.name):
            continue
        p = e.cpu_parent
        while p is not None and not _is_op(p.name):
            p = p.cpu_parent
        if p is None:
            out.append(e)
    return out


def _union_ms(events) -> float:
    """Length of the union of the events' time ranges (ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, lo, hi = 0.0, None, None
    for s, t in spans:
        if hi is None or s > hi:
            total += (hi - lo) if hi is not None else 0.0
            lo, hi = s, t
        else:
            hi = max(hi, t)
    total += (hi - lo) if hi is not None else 0.0
    return total / 1e3


def _count(calls: list) -> dict[str, int]:
    return dict(sorted(Counter(e.name.split(":")[-1] for e in calls).items()))


def _transfers(transfers: list) -> dict[str, float]:
    """name -> MiB the backend's own events record (gloo names its tensors' shapes; 4 bytes an
    element assumed, the float32 of these benchmarks)."""
    by: dict[str, float] = {}
    for e in transfers:
        n = 0
        for shp in e.input_shapes or []:
            if isinstance(shp, list) and shp and all(isinstance(d, int) for d in shp):
                k = 1
                for d in shp:
                    k *= d
                n += k
        name = e.name.split(":", 1)[1]
        by[name] = by.get(name, 0.0) + 4 * n / 2**20
    return {k: round(v, 3) for k, v in sorted(by.items())}


@contextlib.contextmanager
def _counting_tolist(counter: list[int]):
    """While open, each ``Tensor.tolist()`` call on this thread adds one to ``counter[0]``
    (``tolist`` reads the tensor on the host but dispatches no operator the profiler sees);
    ``torch.Tensor.tolist`` is restored on exit."""
    import torch

    orig, me = torch.Tensor.tolist, threading.get_ident()

    @functools.wraps(orig)
    def tolist(self, *a, **kw):
        if threading.get_ident() == me:
            counter[0] += 1
        return orig(self, *a, **kw)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = orig


def _in_step(events) -> tuple[list, list]:
    """``(the step's events, the backend's transfer events)``: the events on the thread of
    the :data:`STEP_RANGE` range within its time window (the range itself left out), and the
    ``gloo:`` transfers that started at or after its start (what the step left in flight
    ends during ``drain``)."""
    rng = next((e for e in events if e.name == STEP_RANGE), None)
    if rng is None:
        return [], []
    lo, hi = rng.time_range.start, rng.time_range.end
    mine = [e for e in events if e is not rng and e.thread == rng.thread
            and e.time_range.start >= lo and e.time_range.end <= hi]
    moved = [e for e in events if e.name.startswith("gloo:") and e.time_range.start >= lo]
    return mine, moved


def breakdown(step: Callable[[], object], *, before: Callable[[], object] | None = None,
              drain: Callable[[], object] | None = None) -> dict:
    """Profile one call of ``step`` (``before`` runs first, outside the timing: a barrier on
    several ranks) and count what it dispatched (see the module docstring). ``drain`` runs
    after the step, still under the profiler but outside ``wall_ms`` and outside the step's
    range, so none of its operators is counted: it waits for what the step left in flight
    (ZeRO's parameter gathers, which the next forward would wait for), so that no backend
    thread records an event while the profiler stops."""
    from torch.profiler import ProfilerActivity, record_function

    from distllm.diagnostics.profiler import profile

    if before is not None:
        before()
    tolists = [0]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 profile_memory=True) as prof:
        t0 = time.perf_counter()
        with record_function(STEP_RANGE), _counting_tolist(tolists):
            step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        if drain is not None:
            drain()
    mine, transfers = _in_step(list(prof.events()))
    top = _top_level(mine)
    op_ms = _union_ms(top)
    names = Counter(e.name for e in mine)
    syncs = (sum(names[n] for n in SYNC_OPS) or sum(names[n] for n in _SYNC_FALLBACK)) \
        + tolists[0]
    grew = [e.self_cpu_memory_usage for e in mine if e.self_cpu_memory_usage > 0]
    calls = _count([e for e in top if e.name.startswith("c10d::")])
    moved = _transfers(transfers)
    per_op: dict[str, list[float]] = {}
    for e in top:
        s = per_op.setdefault(e.name, [0, 0.0])
        s[0] += 1
        s[1] += e.cpu_time_total / 1e3
    top10 = sorted(([n, c, round(ms, 3)] for n, (c, ms) in per_op.items()),
                   key=lambda v: -v[2])[:10]
    return {
        "wall_ms": round(wall_ms, 3), "ops": len(top), "op_ms": round(op_ms, 3),
        "outside_ms": round(max(0.0, wall_ms - op_ms), 3),
        "collectives": sum(calls.values()), "collective_mb": round(sum(moved.values()), 3),
        "by_collective": calls, "by_transfer_mb": moved,
        "copies": sum(names[n] for n in COPY_OPS),
        "allocs": len(grew),
        "alloc_mb": round(sum(grew) / 2**20, 3),
        "syncs": int(syncs),
        "top": top10,
    }


def thread_times() -> dict[int, tuple[str, float, float]]:
    """``{thread id: (name, on-CPU ms, runnable-but-waiting ms)}`` of this process's threads
    (Linux; empty where ``/proc/self/task`` is missing). A thread that ended is absent."""
    out: dict[int, tuple[str, float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns = f.read().split()[:2]
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, int(run_ns) / 1e6, int(wait_ns) / 1e6)
    return out


def cpu_split(step: Callable[[], object], *, before: Callable[[], object] | None = None,
              drain: Callable[[], object] | None = None, reps: int = 3) -> dict:
    """Where this process's CPU went during ``step`` (see the module docstring): medians over
    ``reps`` windows, each after ``before``. A step that leaves work in flight (``drain``
    waits for it: ZeRO's parameter gathers) is measured as a step of a loop, as
    :class:`~distllm.bench.harness.LoopStep` times it: one step runs before the window, so
    the window holds the previous step's gathers finishing beside this step, and ``drain``
    runs after it. Empty where the per-thread times cannot be read."""
    me = threading.get_native_id()
    if me not in thread_times():
        return {}
    rows: list[dict] = []
    for _ in range(reps):
        if before is not None:
            before()
        if drain is not None:
            step()  # leaves its gathers in flight for the measured step to wait for
        t_before = thread_times()
        t0 = time.perf_counter()
        step()
        wall = (time.perf_counter() - t0) * 1e3
        t_after = thread_times()
        if drain is not None:
            drain()
        row = {"wall_ms": wall, "threads": Counter()}
        for tid, (name, run, wait) in t_after.items():
            _, run0, wait0 = t_before.get(tid, (name, 0.0, 0.0))
            if tid == me:
                row["main_cpu_ms"], row["main_wait_ms"] = run - run0, wait - wait0
            else:
                row["threads"][name] += run - run0
        rows.append(row)
    names = sorted({n for r in rows for n in r["threads"]})
    med = lambda vals: round(statistics.median(vals), 3)  # noqa: E731
    threads = {n: med([r["threads"][n] for r in rows]) for n in names}
    return {"wall_ms": med([r["wall_ms"] for r in rows]),
            "main_cpu_ms": med([r["main_cpu_ms"] for r in rows]),
            "main_wait_ms": med([r["main_wait_ms"] for r in rows]),
            "threads_cpu_ms": {n: v for n, v in threads.items() if v > 0.0},
            "other_threads_cpu_ms": round(sum(threads.values()), 3)}


_COUNTS = ("ops", "collectives", "collective_mb", "copies", "allocs", "alloc_mb", "syncs",
           "outside_ms", "op_ms", "wall_ms")
_CPU_COUNTS = ("wall_ms", "main_cpu_ms", "main_wait_ms", "other_threads_cpu_ms")


def compare_breakdowns(ours: dict, peer: dict) -> dict[str, list[float]]:
    """``{count: [ours, peer, ours - peer]}`` for the scalar counts of two breakdowns (and
    of their :func:`cpu_split`, under ``"cpu"``, when both have one)."""
    out = {k: [ours[k], peer[k], round(ours[k] - peer[k], 3)] for k in _COUNTS
           if k in ours and k in peer}
    a, b = ours.get("cpu") or {}, peer.get("cpu") or {}
    out.update({f"cpu.{k}": [a[k], b[k], round(a[k] - b[k], 3)] for k in _CPU_COUNTS
                if k in a and k in b})
    return out
