"""The overlap doctor: is the communication of a distllm.nn model really hidden?

``diagnose(model, step_fn, steps=3)`` runs inside a user's own training (on every rank, as
the steps are collective). It finds the layers that overlap communication with compute
(modules with an ``overlap_stats`` attribute: ``RowParallelLinear``, ``ColumnParallelLinear``
and the blocks built from them), runs ``warmup`` steps (and, on CPU, as many more as
``overlap="auto"``'s trial in the step takes: :func:`~distllm.parallel.tensor.settle_overlap`),
then profiles ``steps`` steps with
``torch.profiler`` while timing each such layer's forward and backward, and reports per layer
and direction:

- the collective (all-reduce, all-gather, reduce-scatter), how many calls ran overlapped,
  the mode that ran (``chunked`` or ``none``) and, for a fallback, why;
- the time blocked on the collective (``wait``) against its standalone time (``comm``,
  from ``overlap="auto"``'s measurement or timed by the doctor on the same group, same size);
  the fraction hidden is the share of the collective's profiled time with compute running
  beside it (CPU), else ``(comm - wait) / comm`` from those timers;
- the layer's time against the ideal ``max(compute, comm)``, ``compute`` being the layer's
  time less the blocked wait.

It fails loudly (raises :class:`OverlapNotHappening`, carrying the report) when an overlap
the user asked for is not happening: by default every layer built with ``overlap="chunked"``
must run its collectives overlapped; with ``require_overlap=True`` every layer that
communicates must (so ``overlap="none"`` or an ``auto`` fallback fails); ``min_hidden`` also
fails layers that overlap but hide less than that fraction. ``distllm bench --doctor`` runs
it on a small built-in model on 2 gloo ranks.

The collective of a layer and direction is the one its ``overlap_stats`` records as having
run (``collective``: ``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``none``); for a
record without that field, or a direction that never went through the overlap engine, it is
inferred from the layer (row- or column-parallel, with or without sequence parallelism).

Usage inside a training script (every rank)::

    from distllm.diagnostics import diagnose
    report = diagnose(model, lambda: train_step(batch), steps=3, require_overlap=True)
    print(report.to_markdown())
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from distllm.diagnostics.probe import Probe, full_numel, fused_parents, snapshot, trace
from distllm.diagnostics.profiler import profile
from distllm.diagnostics.timing import COLLECTIVES, device_sync, time_collective
from distllm.parallel.tensor.layers import settle_overlap

__all__ = ["diagnose", "DoctorReport", "LayerDirection", "OverlapNotHappening"]


class OverlapNotHappening(RuntimeError):
    """An overlap that was asked for did not happen; ``.report`` has the details."""

    def __init__(self, msg: str, report: DoctorReport):
        super().__init__(msg)
        self.report = report

    def __reduce__(self):  # (a worker process's exception reaches its parent whole)
        return type(self), (self.args[0], self.report)


@dataclass
class LayerDirection:
    """One layer, one direction (forward or backward), per step averages in ms."""

    layer: str
    kind: str  # class name of the layer
    direction: str  # forward | backward
    collective: str  # all_reduce | all_gather | reduce_scatter
    requested: str  # the layer's overlap setting: auto | chunked | none
    mode: str  # what ran last: chunked | none
    calls: int
    overlapped: int
    chunks: int
    reason: str
    wait_ms: float | None  # blocked on the collective, per call
    comm_ms: float | None  # the collective alone, per call
    comm_source: str  # "auto" (the layer's own measurement) | "doctor" | ""
    layer_ms: float | None  # the layer's time in this direction, per call
    comm_trace_ms: float | None = None  # the collectives as the profiler saw them, per call
    hidden_trace: float | None = None  # fraction of that time with compute running alongside
    hidden_frac: float | None = None
    hidden_source: str = ""  # trace | timers | blocking
    compute_ms: float | None = None
    ideal_ms: float | None = None
    gap_ms: float | None = None
    profiled_collectives: dict[str, int] = field(default_factory=dict)
    failure: str = ""

    def suspect(self) -> str:
        """Why this row's figures do not describe the collective alone, or "": the host
        waited longer per call than the collective takes alone (another rank still computing,
        or the cores shared), so ``comm_ms`` and the figures built on it do not describe what
        it waited for."""
        if self.overlapped and self.wait_ms is not None and self.comm_ms \
                and self.wait_ms > self.comm_ms:
            return (f"waited {self.wait_ms:.3g} ms per call for a {self.collective} that takes "
                    f"{self.comm_ms:.3g} ms alone: the wait held more than the collective "
                    f"(ranks out of step, or shared cores); its hidden share, ideal and gap "
                    f"are estimates at best")
        return ""

    def finish(self) -> None:
        """Derive hidden fraction, compute, ideal and gap from the measured parts."""
        if self.calls and not self.overlapped:
            self.hidden_frac = 0.0  # a blocking collective hides nothing, whatever the timers
            self.hidden_source = "blocking"
        elif self.hidden_trace is not None:
            self.hidden_frac, self.hidden_source = self.hidden_trace, "trace"
        elif self.comm_ms and self.wait_ms is not None and self.wait_ms <= self.comm_ms:
            self.hidden_frac = (self.comm_ms - self.wait_ms) / self.comm_ms
            self.hidden_source = "timers"
        # (a wait longer than the collective alone takes would read below 0% hidden: the wait
        # held more than the collective, and that share is no measurement; :meth:`suspect`)
        if self.layer_ms is not None and self.wait_ms is not None and self.mode == "deferred":
            # batch split: the layer's window holds its GEMM only; its all-reduce is waited
            # for later, behind the next part's compute, which can hide all of it
            self.compute_ms = self.ideal_ms = self.layer_ms
            self.gap_ms = self.wait_ms
        elif self.layer_ms is not None and self.wait_ms is not None:
            self.compute_ms = max(0.0, self.layer_ms - self.wait_ms)
            if self.comm_ms is not None:
                self.ideal_ms = max(self.compute_ms, self.comm_ms)
                self.gap_ms = self.layer_ms - self.ideal_ms


@dataclass
class DoctorReport:
    steps: int
    step_ms: float
    rows: list[LayerDirection]
    failures: list[str]
    notes: list[str]
    trace: str | None = None
    timeline: list[dict] = field(default_factory=list)  # the last profiled step, two lanes

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return {"steps": self.steps, "step_ms": self.step_ms, "ok": self.ok,
                "failures": self.failures, "notes": self.notes, "trace": self.trace,
                "rows": [asdict(r) for r in self.rows], "timeline": self.timeline}

    def to_markdown(self) -> str:
        def f(x, pct=False):
            if x is None:
                return ""
            return f"{100 * x:.0f}%" if pct else f"{x:.3g}"

        lines = [f"Overlap doctor: {self.steps} profiled step(s), {self.step_ms:.1f} ms per "
                 "step (median).", "",
                 "| layer | dir | collective | asked | ran | overlapped | profiled | wait ms | "
                 "comm ms | hidden | layer ms | ideal ms | gap ms | why |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            ops = {k: v for k, v in r.profiled_collectives.items() if k.startswith("c10d::")}
            # the op without its namespace: c10d::allreduce_, gloo:send (the 2-rank exchange)
            prof = ", ".join(f"{v}x {k.rsplit(':', 1)[-1]}"
                             for k, v in (ops or r.profiled_collectives).items())
            lines.append(
                f"| {r.layer} ({r.kind}) | {r.direction} | {r.collective} | {r.requested} | "
                f"{r.mode}{f' x{r.chunks}' if r.chunks else ''} | {r.overlapped}/{r.calls} | "
                f"{prof} | "
                f"{f(r.wait_ms)} | {f(r.comm_ms)} | {f(r.hidden_frac, True)} {r.hidden_source} | "
                f"{f(r.layer_ms)} | {f(r.ideal_ms)} | {f(r.gap_ms)} | "
                f"{(r.failure or r.reason).replace('|', '/')} |")
        lines += ["", "- hidden: share of the collective's profiled time with compute running "
                  "alongside (trace), else 1 - wait/comm (timers); 0 for a blocking collective"]
        lines += [f"- note: {n}" for n in self.notes]
        lines += [f"- **FAIL**: {x}" for x in self.failures] or ["- all asked-for overlaps ran"]
        return "\n".join(lines)


# ---------------------------------------------------------------- layer discovery


def _layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that keep their own overlap record (``overlap_stats``), outermost names."""
    out = []
    for name, m in model.named_modules():
        st = getattr(m, "overlap_stats", None)
        if st is not None and hasattr(st, "forward") and hasattr(st, "backward"):
            out.append((name or type(m).__name__, m))
    return out


def _recorded_collective(m: torch.nn.Module, direction: str) -> str | None:
    """The collective that the layer's record says ran in ``direction``: the ``collective``
    field of that direction's counter, else of the record itself (a name, or a mapping by
    direction); None where the record has no such field or nothing ran yet."""
    stats = m.overlap_stats
    ran = getattr(getattr(stats, direction, None), "collective", None)
    if ran is None:
        ran = getattr(stats, "collective", None)
        if isinstance(ran, dict):
            ran = ran.get(direction)
    return str(ran) if ran else None


def _inferred_collective(m: torch.nn.Module, direction: str) -> str:
    """Fallback for a record without ``collective``: the collective a Megatron layer runs,
    from its kind (row- or column-parallel) and whether it is sequence-parallel."""
    sp = bool(getattr(m, "sequence_parallel", False))
    row = "Row" in type(m).__name__
    if direction == "forward":
        return ("reduce_scatter" if sp else "all_reduce") if row else "all_gather"
    return ("all_gather" if row else "reduce_scatter") if sp else "all_reduce"


def _collective(m: torch.nn.Module, direction: str) -> str:
    return _recorded_collective(m, direction) or _inferred_collective(m, direction)


def _requested(m: torch.nn.Module) -> str:
    mode = getattr(m, "overlap", None) or getattr(getattr(m, "plan", None), "overlap", None)
    return str(mode) if mode is not None else "?"


def _communicates(m: torch.nn.Module, direction: str, input_grad: bool) -> bool:
    """Whether the layer runs a collective in that direction (tp > 1); the column-parallel
    backward all-reduces dX only when its input needs a gradient."""
    g = _group(m)
    if g is None or dist.get_world_size(g) < 2:
        return False
    ran = _recorded_collective(m, direction)
    if ran is not None:
        return ran != "none"
    if bool(getattr(m, "sequence_parallel", False)):
        return True
    row = "Row" in type(m).__name__
    return row if direction == "forward" else (not row and input_grad)


def _group(m: torch.nn.Module):
    plan = getattr(m, "plan", None)
    for obj, attr in ((plan, "group"), (m, "group"), (m, "tp_group")):
        g = getattr(obj, attr, None) if obj is not None else None
        if g is not None:
            return g
    dims = getattr(m, "dims", None)
    return getattr(dims, "tp_group", None)


def _device_sync(model: torch.nn.Module) -> tuple[Callable[[], None], bool]:
    """A wait for the model's own GPU (:func:`device_sync`: not the current device, cuda:0
    where a rank never set its own), and whether the model is on CUDA."""
    p = next(model.parameters(), None)
    sync = device_sync(p.device) if p is not None else None
    return (sync or (lambda: None)), sync is not None


# ---------------------------------------------------------------- diagnose


def _direction(name, m, d, before, after, probe, traced) -> LayerDirection | None:
    c = getattr(m.overlap_stats, d)
    delta = {k: after[(name, d)][k] - before[(name, d)][k] for k in after[(name, d)]}
    calls = int(delta["calls"])
    input_grad = bool(probe.shapes.get(name, (0, 0, None, None, True))[4])
    if not calls and (_requested(m) != "none" or not _communicates(m, d, input_grad)):
        return None  # every call through the overlap engine is counted: none ran here
    r = LayerDirection(
        layer=name, kind=type(m).__name__, direction=d, collective=_collective(m, d),
        requested=_requested(m), mode=str(getattr(c, "mode", "?")) if calls else "none",
        calls=calls or len(probe.marks.get((name, d), [])), overlapped=int(delta["overlapped"]),
        chunks=int(getattr(c, "chunks", 0)) if calls else 0,
        reason=str(getattr(c, "reason", "")) if calls else
        "the collective ran outside the overlap engine (not recorded per call)",
        wait_ms=delta["wait_ms"] / calls if calls and not probe.cuda else None,
        comm_ms=delta["comm_ms_est"] / calls if calls and delta["comm_ms_est"] else None,
        comm_source="auto" if calls and delta["comm_ms_est"] else "",
        layer_ms=probe.ms(name, d), profiled_collectives=traced[0].get((name, d), {}))
    comm_hid = traced[1].get((name, d))
    if comm_hid and comm_hid[0] > 0 and r.calls and not probe.cuda:  # CPU windows only
        r.comm_trace_ms = comm_hid[0] / r.calls
        r.hidden_trace = min(1.0, comm_hid[1] / comm_hid[0])
    return r


def _measure_comm(rows: list[LayerDirection], layers: dict, probe: Probe) -> None:
    """Time the collective alone for rows that lack the layer's own measurement (same
    order on every rank: the rows come from the same model walk)."""
    for r in rows:
        m = layers[r.layer]
        if r.comm_ms is not None or r.calls == 0 or r.layer not in probe.shapes:
            continue
        if r.collective not in COLLECTIVES:  # "none": nothing to time
            continue
        in_n, out_n, dtype, device, _ = probe.shapes[r.layer]
        g = _group(m)
        n = full_numel(r.collective, r.direction, in_n, out_n, dist.get_world_size(g))
        samples = time_collective(r.collective, n, dtype=dtype, device=device, group=g)
        r.comm_ms, r.comm_source = statistics.median(samples), "doctor"


def _judge(rows: list[LayerDirection], require_overlap: bool | None,
           min_hidden: float | None) -> list[str]:
    fails = []
    for r in rows:
        asked = require_overlap is True or (require_overlap is None and r.requested == "chunked")
        if asked and r.overlapped < max(r.calls, 1):
            r.failure = (f"{r.collective} not overlapped in {max(r.calls, 1) - r.overlapped}/"
                         f"{max(r.calls, 1)} call(s): ran {r.mode} ({r.reason or 'no reason'})")
            fails.append(f"{r.layer} {r.direction}: {r.failure}")
        elif min_hidden is not None and r.overlapped and r.hidden_frac is None:
            # (on CUDA the host never waits: the share is not measured; on CPU a wait longer
            # than the collective alone measures nothing; a gate on it must not pass)
            why = ("CUDA: the host does not wait" if r.wait_ms is None else
                   f"the host waited {r.wait_ms:.3g} ms per call, longer than the "
                   f"{r.comm_ms:.3g} ms the collective takes alone" if r.comm_ms else
                   "no standalone time of the collective")
            r.failure = (f"the hidden share of the {r.collective} was not measured ({why}), "
                         f"so min_hidden={min_hidden:g} cannot be checked: read the trace")
            fails.append(f"{r.layer} {r.direction}: {r.failure}")
        elif (min_hidden is not None and r.overlapped and r.hidden_frac is not None
              and r.hidden_frac < min_hidden):
            r.failure = f"only {100 * r.hidden_frac:.0f}% of the {r.collective} hidden " \
                        f"(asked for at least {100 * min_hidden:.0f}%)"
            fails.append(f"{r.layer} {r.direction}: {r.failure}")
    return fails


def _profile(step_fn, steps: int, probe: Probe, sync, cuda: bool):
    """``steps`` calls of ``step_fn`` under the profiler with the probe's hooks on."""
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    step_ms = []
    probe.attach()
    try:
        with profile(activities=acts) as prof, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for _ in range(steps):
                t0 = time.perf_counter()
                with torch.profiler.record_function("doctor-step"):
                    step_fn()
                    sync()
                step_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        probe.detach()
    return prof, step_ms


def _notes(probe: Probe, layers: list, rows: list[LayerDirection], cuda: bool) -> list[str]:
    notes = list(probe.notes)
    if not layers:
        notes.append("no layer with overlap_stats in this model (build it from distllm.nn)")
    if cuda:
        notes.append("CUDA: the host never blocks on collectives and kernels run after their "
                     "launch, so per-layer wait and hidden are not measured; the step "
                     "timeline (GPU kernels) and the profiler trace show the overlap")
    notes += [f"{r.layer} {r.direction}: overlap='auto' fell back to none ({r.reason})"
              for r in rows if r.requested == "auto" and r.calls and not r.overlapped]
    notes += [f"{r.layer} {r.direction}: {r.suspect()}" for r in rows if r.suspect()]
    return notes


def diagnose(model: torch.nn.Module, step_fn: Callable[[], object], steps: int = 3, *,
             warmup: int = 1, require_overlap: bool | None = None,
             min_hidden: float | None = None, measure_comm: bool = True,
             trace_path: str | None = None, raise_on_failure: bool = True) -> DoctorReport:
    """Profile ``steps`` calls of ``step_fn`` (after ``warmup`` more) and report, per
    overlap-capable layer of ``model``, what overlapped and how much was hidden.

    Call it on every rank (steps and the standalone collective timings are collective).
    ``require_overlap``: None = layers built with ``overlap="chunked"`` must overlap;
    True = every communicating layer must; False = report only. ``min_hidden``: also fail
    an overlapped collective that hides less than this fraction. ``trace_path``: write the
    profiler's Chrome trace there. Raises :class:`OverlapNotHappening` on failure (unless
    ``raise_on_failure=False``); the report is on the exception.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    layers = _layers(model)
    sync, cuda = _device_sync(model)
    for _ in range(warmup - 1):  # overlap="auto" measures and caches its choice here
        step_fn()
    if warmup:  # the last warm-up step, and on CPU as many more as auto's trial in the step
        settle_overlap(step_fn, model)  # takes (until every rank's layers have decided)
    sync()
    device = next((p.device for p in model.parameters()), None)
    probe, before = Probe(layers, cuda, fused_parents(model), device), snapshot(layers)
    prof, step_ms = _profile(step_fn, steps, probe, sync, cuda)
    if trace_path:  # whole or not at all: written beside it, then renamed over it
        part = f"{trace_path}.part-{os.getpid()}"
        try:
            prof.export_chrome_trace(part)
            os.replace(part, trace_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
    after, traced = snapshot(layers), trace(prof, probe.together())
    rows = [r for name, m in layers for d in ("forward", "backward")
            if (r := _direction(name, m, d, before, after, probe, traced)) is not None]
    if measure_comm:
        _measure_comm(rows, dict(layers), probe)
    for r in rows:
        r.finish()
    notes = _notes(probe, layers, rows, cuda)
    fails = _judge(rows, require_overlap, min_hidden)
    if require_overlap and not layers:
        fails.append("overlap was required but the model has no overlap-capable layer")
    rep = DoctorReport(steps, statistics.median(step_ms), rows, fails, notes,
                       str(trace_path) if trace_path else None, traced[2])
    if fails and raise_on_failure:
        raise OverlapNotHappening("overlap asked for but not happening:\n  " +
                                  "\n  ".join(fails), rep)
    return rep
