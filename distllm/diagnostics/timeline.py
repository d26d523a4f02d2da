"""One step as two lanes, compute and communication, read from a ``torch.profiler`` run.

- **comm**: the collectives as they actually ran: gloo's ``gloo:<op>`` events on its worker
  threads (CPU), NCCL kernels on the GPU (not the host's ``nccl:<op>`` ranges, which span
  only the launch);
- **compute**: the operators on the thread that ran the step (CPU: ``aten::`` and
  ``distllm::`` ops, without the collectives' launch and wait calls); on CUDA, the GPU
  kernels that are not NCCL.

The hidden part of the communication is the time during which both lanes are busy:
``hidden = |comm ∩ compute| / |comm|`` over merged intervals. Events are dicts with
``lane``, ``name``, ``start_ms`` and ``end_ms``: the timeline that the overlap doctor
reports and that ``distllm bench`` draws when a benchmark row carries one
(``row(..., timeline=profile_timeline(step))``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from distllm.diagnostics.profiler import profile

__all__ = ["lanes", "profile_timeline", "merge", "overlap_ms", "hidden", "COMM_MARKERS"]

COMM_MARKERS = ("gloo:", "nccl")  # a collective running (worker thread / GPU kernel)
_LAUNCH = ("c10d::", "record_param_comms", "wait", "barrier", "profiler", "autograd::engine",
           "doctor-step")  # launches, waits, and wrappers that span them


def merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two interval sets (each merged first)."""
    a, b = merge(a), merge(b)
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _is_comm(name: str) -> bool:
    n = name.lower()
    return any(n.startswith(m) or (m == "nccl" and "nccl" in n) for m in COMM_MARKERS)


def _is_compute_op(name: str) -> bool:
    n = name.lower()
    return "::" in n and not n.startswith("doctor::") and not any(k in n for k in _LAUNCH) \
        and not _is_comm(n)


def lanes(prof, window: tuple[float, float] | None = None,
          origin: float | None = None) -> list[dict]:
    """Timeline events from a finished profiler run, optionally only those starting inside
    ``window`` (µs, profiler clock); in ms from ``origin`` (µs; default the first event)."""
    evs = [e for e in prof.events()
           if window is None or window[0] <= e.time_range.start <= window[1]]
    cpu = [e for e in evs if str(getattr(e, "device_type", "")).endswith("CPU")]
    gpu = [e for e in evs if not str(getattr(e, "device_type", "")).endswith("CPU")]
    main = Counter(e.thread for e in cpu if _is_compute_op(e.name)).most_common(1)
    out = []
    for e in gpu:
        out.append(("comm" if _is_comm(e.name) else "compute", e))
    for e in cpu:
        # with GPU events, the comm lane is the NCCL kernels: a host ``nccl:<op>`` range is
        # the launch, which runs ahead of the GPU beside whatever kernel runs then
        if _is_comm(e.name) and (not gpu or e.name.lower().startswith("gloo:")):
            out.append(("comm", e))
        elif not gpu and main and e.thread == main[0][0] and _is_compute_op(e.name):
            out.append(("compute", e))
    if not out:
        return []
    t0 = min(e.time_range.start for _, e in out) if origin is None else origin
    raw = [(lane, e.name.split("::")[-1], (e.time_range.start - t0) / 1e3,
            (e.time_range.end - t0) / 1e3) for lane, e in out]
    comm = [{"lane": "comm", "name": n, "start_ms": s, "end_ms": t}
            for lane, n, s, t in sorted(raw, key=lambda r: r[2]) if lane == "comm"]
    return _blocks([r for r in raw if r[0] == "compute"]) + comm


def _blocks(ops: list[tuple[str, str, float, float]], gap_ms: float = 0.05) -> list[dict]:
    """Compute ops merged into busy blocks (gaps under ``gap_ms`` closed), each named after
    its longest op."""
    out: list[dict] = []
    best: list[float] = []
    for _, n, s, t in sorted(ops, key=lambda r: r[2]):
        if out and s <= out[-1]["end_ms"] + gap_ms:
            out[-1]["end_ms"] = max(out[-1]["end_ms"], t)
            if t - s > best[-1]:
                out[-1]["name"], best[-1] = n, t - s
        else:
            out.append({"lane": "compute", "name": n, "start_ms": s, "end_ms": t})
            best.append(t - s)
    return out


def _iv(tl: list[dict], lane: str) -> list[tuple[float, float]]:
    return [(float(e["start_ms"]), float(e["end_ms"])) for e in tl if e["lane"] == lane]


def hidden(tl: list[dict]) -> tuple[float, float]:
    """(communication ms, of which hidden under compute ms) of a timeline."""
    comm = merge(_iv(tl, "comm"))
    return sum(e - s for s, e in comm), overlap_ms(comm, _iv(tl, "compute"))


def profile_timeline(fn: Callable[[], object], warmup: int = 1,
                     before: Callable[[], object] | None = None,
                     device: torch.device | None = None) -> list[dict]:
    """Run ``fn`` ``warmup`` times, then once under the profiler; its timeline events.
    Collective when ``fn`` is (call it on every rank; ``before``, e.g. a barrier on the
    group, runs just before the profiled call so that rank skew is not measured). On CUDA,
    the profiler stops once ``device`` (the GPU ``fn`` works on; default the current one)
    has finished its work."""
    for _ in range(warmup):
        fn()
    if before is not None:
        before()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return lanes(prof)
