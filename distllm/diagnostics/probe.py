"""Measuring probes of the overlap doctor (:mod:`distllm.diagnostics.doctor`): per-layer
hooks that time each forward and backward and open a profiler range around it, the read-out
of the profiler's events per layer range, and the size of the tensor a layer's collective
moves (timed alone with :func:`distllm.diagnostics.timing.time_collective`).
"""

from __future__ import annotations

import statistics
import time

import torch

from distllm.diagnostics import timeline

__all__ = ["Probe", "fused_parents", "snapshot", "trace", "full_numel"]

_COLL_NAMES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
               "reducescatter", "gloo:", "nccl:")


def fused_parents(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``id(layer) -> module`` for the layers a module computes inside its own function
    instead of calling them (it names them in ``FUSED_CHILDREN``, as ``ParallelMLP`` does)."""
    out = {}
    for m in model.modules():
        for child in getattr(type(m), "FUSED_CHILDREN", ()):
            sub = getattr(m, child, None)
            if isinstance(sub, torch.nn.Module):
                out[id(sub)] = m
    return out


class Probe:
    """Forward/backward hooks on each layer: a profiler range and a timer per call, and
    the shapes of the last forward (for timing the collective alone)."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]], cuda: bool,
                 fused_into: dict[int, torch.nn.Module] | None = None,
                 device: torch.device | None = None):
        # on CUDA, events go on the model's GPU (``device``), not the current one (cuda:0
        # where a rank never set its own: an idle stream, which would time the host)
        self.layers, self.cuda, self.device = layers, cuda, device
        self.fused_into = fused_into or {}  # id(layer) -> the module whose function runs it
        self.marks: dict[tuple[str, str], list[list]] = {}
        self.shapes: dict[str, tuple] = {}
        self.handles: list = []
        self.open: dict[tuple[str, str], tuple] = {}
        self.notes: list[str] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _begin(self, name: str, d: str) -> None:
        rf = torch.profiler.record_function(f"doctor::{name}::{d}")
        rf.__enter__()
        self.open[(name, d)] = (rf, self._now())

    def _end(self, name: str, d: str) -> None:
        rf, t0 = self.open.pop((name, d), (None, None))
        if rf is None:
            return
        rf.__exit__(None, None, None)
        self.marks.setdefault((name, d), []).append([t0, self._now()])

    def _fwd_post(self, name: str, m, args, out) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        y = out if isinstance(out, torch.Tensor) else None
        if x is not None and y is not None:
            self.shapes[name] = (x.numel(), y.numel(), y.dtype, y.device, x.requires_grad)
        self._end(name, "forward")

    def together(self) -> dict[str, list[str]]:
        """Each layer timed with siblings (one fused function): the names timed together."""
        return {n: names for _, names in self._hooked() if len(names) > 1 for n in names}

    def _hooked(self) -> list[tuple[torch.nn.Module, list[str]]]:
        """The modules to hook and the layer names each one times: a layer computed inside
        another module's function (``ParallelMLP``'s fc1 and fc2, run as one fused MLP,
        see :func:`fused_parents`) is timed by that module, together with its siblings."""
        out: list[tuple[torch.nn.Module, list[str]]] = []
        by_parent: dict[int, int] = {}
        for name, m in self.layers:
            parent = self.fused_into.get(id(m))
            if parent is None:
                out.append((m, [name]))
            elif id(parent) in by_parent:
                out[by_parent[id(parent)]][1].append(name)
            else:
                by_parent[id(parent)] = len(out)
                out.append((parent, [name]))
        return out

    @staticmethod
    def _each(names: list[str], fn, *args) -> None:
        for n in names:
            fn(n, *args)

    def attach(self) -> None:
        for m, names in self._hooked():
            rev = names[::-1]
            # hooks return None: a value would replace the module's input / output
            self.handles += [
                m.register_forward_pre_hook(
                    lambda m, a, ns=names: self._each(ns, self._begin, "forward")),
                m.register_forward_hook(
                    lambda m, a, o, ns=rev: self._each(ns, self._fwd_post, m, a, o))]
            if len(names) > 1:
                self.notes.append(f"{', '.join(names)}: run as one fused function, timed "
                                  "together (each row shows the whole function's time, and "
                                  "its collectives and their hidden share)")
            try:
                self.handles += [
                    m.register_full_backward_pre_hook(
                        lambda m, g, ns=names: self._each(ns, self._begin, "backward")),
                    m.register_full_backward_hook(
                        lambda m, gi, go, ns=rev: self._each(ns, self._end, "backward"))]
            except RuntimeError as exc:  # e.g. a module already using the old-style hooks
                self.notes.append(f"{', '.join(names)}: backward not timed ({exc})")

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def ms(self, name: str, d: str) -> float | None:
        """Mean time per call (ms) of one layer in one direction: the mean, as the layer's
        wait and communication times per call are (sums over its calls), so that compute =
        layer - wait is of one statistic (a median layer time under a mean wait read a
        wait longer than the layer)."""
        pairs = self.marks.get((name, d)) or []
        if not pairs:
            return None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return statistics.fmean(a.elapsed_time(b) for a, b in pairs)
        return statistics.fmean((b - a) * 1e3 for a, b in pairs)


def snapshot(layers) -> dict[tuple[str, str], dict]:
    out = {}
    for name, m in layers:
        for d in ("forward", "backward"):
            c = getattr(m.overlap_stats, d)
            out[(name, d)] = {k: getattr(c, k, 0) for k in
                              ("calls", "overlapped", "wait_ms", "comm_ms_est")}
    return out


def trace(prof, together: dict[str, list[str]] | None = None
          ) -> tuple[dict, dict, list[dict]]:
    """From the profiler: collectives per layer range by op name; (comm ms, hidden ms) per
    layer range (comm lane events starting inside it, against all compute); the last step's
    timeline. Layers run as one fused function (``together``: name -> the names timed with
    it) open nested ranges over one window: each of them gets the whole function's
    collectives, as it gets its comm and hidden time (the innermost range alone had them)."""
    together = together or {}
    ranges, colls, steps = [], [], []
    for e in prof.events():
        if e.name == "doctor-step":
            steps.append((e.time_range.start, e.time_range.end))
        elif e.name.startswith("doctor::"):
            _, name, d = e.name.rsplit("::", 2)
            ranges.append((e.time_range.start, e.time_range.end, name, d))
        elif any(k in e.name.lower() for k in _COLL_NAMES):
            colls.append((e.time_range.start, e.name))
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for t, cname in colls:
        inside = [r for r in ranges if r[0] <= t <= r[1]]
        if inside:
            s, e, name, d = max(inside, key=lambda r: r[0])  # the innermost range
            for n in together.get(name, [name]):
                bucket = counts.setdefault((n, d), {})
                bucket[cname] = bucket.get(cname, 0) + 1
    ev = timeline.lanes(prof, origin=0.0)  # ms on the profiler clock
    comm = [(x["start_ms"], x["end_ms"]) for x in ev if x["lane"] == "comm"]
    compute = [(x["start_ms"], x["end_ms"]) for x in ev if x["lane"] == "compute"]
    hid: dict[tuple[str, str], list[float]] = {}
    for s, e, name, d in ranges:
        mine = timeline.merge([iv for iv in comm if s / 1e3 <= iv[0] <= e / 1e3])
        if mine:
            acc = hid.setdefault((name, d), [0.0, 0.0])
            acc[0] += sum(b - a for a, b in mine)
            acc[1] += timeline.overlap_ms(mine, compute)
    step_tl = timeline.lanes(prof, window=steps[-1]) if steps else []
    return counts, hid, step_tl


def full_numel(coll: str, direction: str, in_n: int, out_n: int, tp: int) -> int:
    """Elements of the full (unsharded) tensor that ``coll`` moves in ``direction``, from
    the numbers of elements of the layer's input and output on this rank.

    Forward, an all-gather acts on the input (column-parallel under sequence parallelism)
    and the others on the output (row-parallel); backward, an all-gather acts on the
    output's gradient (row-parallel) and the others on the input's (column-parallel).
    """
    acts_on_input = (coll == "all_gather") == (direction == "forward")
    n = in_n if acts_on_input else out_n
    return n if coll == "all_reduce" else n * tp
