"""Benchmark: data-parallel training steps, gradient reduction overlapped with backward.

2 gloo ranks (1 thread each) train a GPT-like stack (pre-LN blocks: attention + 4h MLP,
fp32, AdamW) on random activations; each timed call is one whole step (zero_grad, forward,
backward, gradient sync, optimizer step), the time being the max over ranks. Variants,
interleaved in one run at the same bucket size (25 MB unless swept):

suite ``ddp``:
- ``distllm_ddp``: :class:`distllm.parallel.DistributedDataParallel` (buckets all-reduced
  from post-accumulate-grad hooks during backward);
- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` (default settings);
- ``no_overlap``: ``distllm_ddp`` with ``overlap_grad_reduce=False``: the same hooks copy
  each gradient into its bucket during backward, and every bucket is all-reduced after it;
- ``ddp_auto``: ``distllm_ddp`` with ``overlap_grad_reduce="auto"``, its trial run
  before the timing (so its timed steps run the schedule it chose, that of ``distllm_ddp``
  or of ``no_overlap``); its row says what it chose and why (``extra.auto_decision``) and
  its time against the faster of the two (``extra.vs_best_schedule``);
- parts, timed alone: ``fwd_alone``, ``fwd_bwd_alone`` (backward with the same buckets
  filled by the same hooks, under ``no_sync``: no communication), ``comm_alone`` (the
  bucketed all-reduce of the gradients), ``opt_alone`` (the AdamW step);
- ``no_overlap`` and ``comm_alone`` run distllm's all-reduce
  (:func:`distllm.comm.collectives.all_reduce`, on 2 gloo ranks the exchange), as
  ``distllm_ddp`` does, so that they differ from it only in the overlap, and the parts add
  up to ``no_overlap``'s step (a backward without the bucket copies would leave them out
  of the parts, and the share below would read low by their time over what can hide);
- ``ideal``: ``fwd + max(bwd, comm) + opt`` from the parts' medians (a bound, not timed);
- ``ddp_cap<MB>``: distllm DDP at other bucket sizes (the sweep), with ``torch_ddp`` again.

suite ``zero``: ``zero1``, ``zero2``, ``zero3`` (prefetch on), ``zero3_noprefetch``,
``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per block, where it runs on CPU), each
against ``distllm_ddp`` in the same interleaved run. ``zero1`` and ``zero2`` leave the
all-gather of the updated parameters to the next forward, so each of their timed calls is
the middle step of three (:class:`distllm.bench.harness.LoopStep`), as in a training loop.

``hidden_frac = (fwd + bwd + comm + opt - variant) / min(bwd, comm)`` from the parts alone:
the share of what could hide (the reduction under backward) that the variant hid; its
ceiling is 1 (``extra.hidden_ceiling``), and a row above it is a measurement error that the
report flags; ``extra.hidden_band`` is its p10..p90 taken round by round
(:func:`_hidden_band`). Where what can hide is no larger than the p10..p90 width of a part,
the share is not reported (``extra.hidden_unresolved``, as in the row suite). torch DDP's
rows use the same parts (its first bucket is smaller: an approximation). ``peak_mem_mb``:
MiB (2**20 bytes) of parameters + gradients + optimizer state held per rank after a step,
measured from the tensors (:func:`distllm.parallel.memory_report`; activations and transient buffers
excluded; torch DDP's internal buckets are not visible and not counted).
``extra.grad_opt_mb``: the gradient + optimizer part alone. Rows of ``TIMELINES`` carry one
profiled step of rank 0 (``timeline``, from :mod:`distllm.diagnostics.timeline`) and
``profiled_hidden_frac``, the share of the collectives' running time under compute.

Cases are phases (``ddp``, ``zero``, and without ``quick`` the bucket-size ``sweep``), each
on 2 ranks over loopback and ``cfg.net`` through :mod:`distllm.testing.netem`; where the
link cannot be built, a quick run's rows say so and run on loopback, and a full run has one
``unavailable`` row for the rate (:func:`distllm.bench.harness.run_case`).
Run: ``distllm bench --suite ddp,zero --net 10gbit``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Case, LoopStep, Result, Setup, build_and_step
from distllm.bench.row_parallel_overlap import unresolved
from distllm.bench.rows import judge_target, row
from torch import nn

from distllm.comm.collectives import all_reduce
from distllm.diagnostics.timeline import hidden, profile_timeline
from distllm.diagnostics.timing import Stats, paired_band

SUITE_DDP, SUITE_ZERO = "ddp", "zero"
SUITE = SUITE_DDP  # cases of the zero phase name their suite
# (hidden, layers, heads, batch, seq): full ~20M parameters; quick ~1.6M
_PRESETS = {False: (640, 4, 10, 4, 16), True: (256, 2, 4, 2, 16)}
SWEEP_MB = (1, 5, 25, 100)
TIMELINES = ("distllm_ddp", "torch_ddp", "no_overlap", "zero2", "zero3")  # one profiled step


class Block(nn.Module):
    """Pre-LN transformer block: attention (fused QKV) then a 4h GeLU MLP."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(  # (b, heads, s, h/heads)
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class GPTStack(nn.Module):
    def __init__(self, h: int, layers: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x)




def _model(shape) -> GPTStack:
    h, layers, heads, _, _ = shape
    torch.manual_seed(0)
    return GPTStack(h, layers, heads)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _mb(n: int) -> float:
    return n / 2**20


# --- variant builders: each returns (step fn, memory dict) -------------------------------------
def _ddp(overlap: bool | str = True):
    """The builder of distllm DDP with ``overlap_grad_reduce=overlap``: ``distllm_ddp``
    (True), ``no_overlap`` (False: every bucket all-reduced at the end of backward) and
    ``ddp_auto`` ("auto": its trial runs here, before the timing, the same number of steps on
    every rank; the step carries what it chose as ``step.decision``)."""
    def build(shape, x, dims, cap):
        from distllm.parallel import DistributedDataParallel, memory_report

        m = _model(shape)
        d = DistributedDataParallel(m, dims=dims, bucket_cap_mb=cap, overlap_grad_reduce=overlap)
        opt = _adamw(m.parameters())

        def step():
            d.zero_grad()
            d(x).pow(2).mean().backward()
            opt.step()

        if overlap == "auto":
            trial_steps = 0
            while d.reducer.tuning:
                step()
                trial_steps += 1
            step.decision = {"auto_decision": d.reducer.overlap_reason,
                             "auto_overlaps": d.reducer.overlap,
                             "auto_trial_steps": trial_steps}
        return step, lambda: memory_report(d, optimizer=opt)

    return build


_distllm_ddp = _ddp()


def _torch_ddp(shape, x, dims, cap):
    from distllm.parallel import memory_report

    m = _model(shape)
    t = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap)
    opt = _adamw(m.parameters())

    def step():
        opt.zero_grad()
        t(x).pow(2).mean().backward()
        opt.step()

    return step, lambda: memory_report(m, optimizer=opt)


def _zero(stage, prefetch=True):
    def build(shape, x, dims, cap):
        from distllm.parallel import ZeroOptimizer

        m = _model(shape)
        z = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, dims=dims, bucket_cap_mb=cap,
                          prefetch=prefetch, lr=1e-4, foreach=False)

        def step():
            z.zero_grad()
            m(x).pow(2).mean().backward()
            z.step()

        # stages 1-2 leave the parameter all-gathers to the next forward: timed in a loop
        return (LoopStep(step, z.wait_params) if stage in (1, 2) else step), z.memory_report

    return build


def _fsdp2(shape, x, dims, cap):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distllm.parallel.data.memory import MemoryReport

    m = _model(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = _adamw(m.parameters())

    def step():
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()

    def mem():
        def local(t):  # this rank's shard (params share one flat storage: count elements)
            t = getattr(t, "_local_tensor", t)
            return t.numel() * t.element_size() if t is not None else 0

        ps = list(m.parameters())
        st = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return MemoryReport(sum(local(p) for p in ps), sum(local(p.grad) for p in ps),
                            sum(local(v) for v in st))

    return step, mem


def _parts(shape, x, dims, cap) -> dict:
    """The parts alone: forward; forward + backward with the gradients copied into the
    buckets by :class:`DistributedDataParallel`'s hooks (under ``no_sync``: no
    communication; the copy the timed variants make, there with the division by the group
    size folded in); the bucketed all-reduce of gradient-sized buffers (the same buckets,
    launched asynchronously and waited for at the end, as :class:`DistributedDataParallel`
    does); and the AdamW step, on a replica of its own that keeps its gradients."""
    from distllm.parallel import DistributedDataParallel

    m = _model(shape)
    d = DistributedDataParallel(m, dims=dims, bucket_cap_mb=cap)
    bufs = [torch.zeros(n) for n in d.bucket_sizes]  # zeros: no denormals to slow the sum
    m_opt = _model(shape)
    opt = _adamw(m_opt.parameters())
    m_opt(x).pow(2).mean().backward()

    def fwd():
        d(x).pow(2).mean()

    def fwd_bwd():
        d.zero_grad()
        with d.no_sync():
            d(x).pow(2).mean().backward()

    def comm():  # as DistributedDataParallel runs it: launch each async, wait all
        works = [all_reduce(b, async_op=True) for b in bufs]
        for w in works:
            w.wait()

    return {"fwd_alone": fwd, "fwd_bwd_alone": fwd_bwd, "comm_alone": comm,
            "opt_alone": opt.step}


_BUILDERS = {
    "distllm_ddp": _distllm_ddp, "torch_ddp": _torch_ddp, "no_overlap": _ddp(False),
    "ddp_auto": _ddp("auto"),
    "zero1": _zero(1), "zero2": _zero(2), "zero3": _zero(3), "zero3_noprefetch": _zero(3, False),
    "fsdp2": _fsdp2,
}
PHASES = {
    "ddp": ["distllm_ddp", "torch_ddp", "no_overlap", "ddp_auto"],
    "zero": ["distllm_ddp", "zero1", "zero2", "zero3", "zero3_noprefetch", "fsdp2"],
    "sweep": ["torch_ddp"] + [f"ddp_cap{c}" for c in SWEEP_MB],
}


def cases(cfg: BenchConfig) -> list[Case]:
    """One case per phase: ``ddp`` (and without ``quick`` its bucket-size ``sweep``) when the
    ``ddp`` suite is asked for, ``zero`` when ``zero`` is; each on 2 ranks."""
    wanted = cfg.extra.get("suites") or [SUITE_DDP, SUITE_ZERO]
    if cfg.device != "cpu":
        return [Case("-", suite=s, skip="the CPU suite (gloo ranks); the GPU run is the "
                     "training benchmark") for s in (SUITE_DDP, SUITE_ZERO) if s in wanted]
    phases = (["ddp"] if SUITE_DDP in wanted else []) + (
        ["zero"] if SUITE_ZERO in wanted else []) + (
        ["sweep"] if SUITE_DDP in wanted and not cfg.quick else [])
    return [Case(p, {"phase": p}, ranks=2, networks=True,
                 suite=SUITE_ZERO if p == "zero" else SUITE_DDP) for p in phases]


def _one_step(v: Callable[[], object]) -> Callable[[], object]:
    """One step of a variant (a :class:`LoopStep` runs three), for its profiled timeline;
    what it leaves in flight is waited for with it."""
    if isinstance(v, LoopStep):
        return lambda: (v.step(), v.drain())
    return v


def setup(cfg: BenchConfig, case: Case) -> Setup:
    """Every variant of the phase on this rank (one that cannot be built here, or whose
    first step fails, is listed with its error); afterwards each one's memory and one
    profiled step."""
    from distllm import ParallelDims

    shape, phase, cap = _PRESETS[cfg.quick], case.params["phase"], 25.0
    dims = ParallelDims()
    _, _, _, batch, seq = shape
    torch.manual_seed(1 + dims.rank)
    x = torch.randn(batch, seq, shape[0])  # (b, s, h) activations of this rank's rows
    variants, mems, missing = {}, {}, {}
    for name in PHASES[phase]:
        c = float(name[len("ddp_cap"):]) if name.startswith("ddp_cap") else cap
        build = _distllm_ddp if name.startswith("ddp_cap") else _BUILDERS[name]
        built, why = build_and_step(lambda b=build, c=c: b(shape, x, dims, c),
                                    lambda sm: sm[0]())
        if why is None:
            variants[name], mems[name] = built
        else:
            missing[name] = why
    if phase == "ddp":
        variants.update(_parts(shape, x, dims, cap))

    def finish(stats: dict[str, Stats]) -> dict:
        mem = {n: f().as_dict() for n, f in mems.items()}
        timelines = {n: profile_timeline(_one_step(variants[n]), warmup=0, before=dist.barrier)
                     for n in TIMELINES if n in variants}
        return {"mem": mem, "timelines": timelines,
                "psi": sum(p.numel() for p in _model(shape).parameters()),
                "auto": {n: v.decision for n, v in variants.items() if hasattr(v, "decision")}}

    return Setup(variants, missing, warmup=2, reps=cfg.reps or (3 if cfg.quick else 10),
                 finish=finish)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    shape, info = _PRESETS[cfg.quick], result.info[0]
    res = {"stats": result.stats, "missing": result.unavailable, **info}
    label = f"{result.net} {info['psi'] / 1e6:.1f}M b{shape[3]}s{shape[4]}h{shape[0]}"
    build = {"ddp": _ddp_rows, "zero": _zero_rows, "sweep": _sweep_rows}[case.params["phase"]]
    return build(res, label, result.net, result.net_reason)


# --- rows ----------------------------------------------------------------------------------------
def _rowkw(res: dict, name: str, label: str, reason: str) -> dict:
    m = res["mem"].get(name)
    kw = {"device": "cpu", "dtype": "float32", "reason": reason, "net": label}
    tl = res.get("timelines", {}).get(name)
    if tl:  # rank 0's profiled step: the share of its collectives' time under compute
        comm, hid = hidden(tl)
        kw.update(timeline=tl, profiled_hidden_frac=hid / comm if comm else None)
    if m:
        kw.update(peak_mem_mb=_mb(m["total"]), grad_opt_mb=_mb(m["grads"] + m["optimizer"]))
    return kw


_PARTS = ("fwd_alone", "fwd_bwd_alone", "comm_alone", "opt_alone")


def _share(v: float, fwd: float, fwd_bwd: float, comm: float, opt: float) -> float | None:
    """The hidden share of a step of ``v`` ms from its parts alone (module docstring): what
    can hide is ``min(bwd, comm)``, only backward running while gradients are reduced."""
    can_hide = min(fwd_bwd - fwd, comm)
    return (fwd_bwd + comm + opt - v) / can_hide if can_hide > 0 else None


def _hidden_band(st: dict[str, Stats], s: Stats) -> tuple[float, float] | None:
    """p10..p90 of :func:`_share` of the variant timed ``s``, round by round: repetition
    ``i`` of the variant and of every part ran in the same round; widened to hold the share
    of the medians printed with it."""
    band = paired_band(_share, s.samples_ms, *(st[n].samples_ms for n in _PARTS))
    mid = _share(s.median_ms, *(st[n].median_ms for n in _PARTS))
    if band is None or mid is None:
        return band
    return min(band[0], mid), max(band[1], mid)


def _vs_parts(st: dict[str, Stats], parts: float) -> dict:
    """``no_overlap``'s step against its parts one after the other (``fwd_bwd + comm +
    opt``): ``vs_parts`` of the medians, ``vs_parts_band`` (p10..p90 round by round, else
    the widest ratio of the p10..p90 bands) and ``parts_add_up``, whether 1 is within that
    band. Where they do not add up, the shares computed from the parts are off by the
    difference; {} without ``no_overlap``."""
    if "no_overlap" not in st:
        return {}
    v, *ps = (st[n] for n in ("no_overlap", "fwd_bwd_alone", "comm_alone", "opt_alone"))
    band = paired_band(lambda x, *p: x / sum(p), v.samples_ms, *(p.samples_ms for p in ps))
    if band is None:
        band = (v.p10_ms / sum(p.p90_ms for p in ps), v.p90_ms / sum(p.p10_ms for p in ps))
    return {"parts_ms": parts, "vs_parts": v.median_ms / parts, "vs_parts_band": band,
            "parts_add_up": band[0] <= 1.0 <= band[1]}


def _hidden_kw(st: dict[str, Stats], s: Stats, can_hide: float, ideal: float) -> dict:
    """The hidden share of a step timed ``s`` (None where it is within the parts' noise)."""
    med = {n: st[n].median_ms for n in _PARTS}
    hid = _share(s.median_ms, *(med[n] for n in _PARTS))
    kw = {"vs_ideal": s.median_ms / ideal, "hideable_ms": can_hide, "hidden_ceiling": 1.0,
          "hidden_band": _hidden_band(st, s)}
    why = unresolved(can_hide, *(st[n] for n in _PARTS))
    if why and hid is not None:  # noise of the parts, not a share: kept, not reported
        kw.update(hidden_unresolved=why, hidden_frac_unresolved=hid)
        hid = None
    return {**kw, "hidden_frac": hid}


def _vs_ideal_band(st: dict[str, Stats], s: Stats) -> tuple[float, float] | None:
    """p10..p90 of the step timed ``s`` over ``fwd + max(bwd, comm) + opt``, round by round."""
    return paired_band(lambda v, f, fb, c, o: v / (f + max(fb - f, c) + o), s.samples_ms,
                       *(st[n].samples_ms for n in _PARTS))


def _ratios(name: str, s: Stats, st: dict[str, Stats], label: str, vs_ideal: float) -> dict:
    """``ddp_auto`` against the schedules it chose from, ``distllm_ddp`` against torch's
    (and its target: ``meets_target`` the medians', ``target_status`` the bands',
    :func:`~distllm.bench.rows.judge_target`): each only where the other variant ran."""
    med = {n: x.median_ms for n, x in st.items()}
    kw: dict = {}
    if name == "ddp_auto":
        ran = {n: med[n] for n in ("distllm_ddp", "no_overlap") if n in med}
        kw.update({f"vs_{n}": s.median_ms / ms for n, ms in ran.items()})
        if ran:
            kw["vs_best_schedule"] = s.median_ms / min(ran.values())
    if name == "distllm_ddp" and "torch_ddp" in med:
        kw["vs_torch_ddp"] = s.median_ms / med["torch_ddp"]
        bar = 1.03 if label == "loopback" else 1.00  # over an emulated link: not slower
        kw["meets_target"] = kw["vs_torch_ddp"] <= bar and (label == "loopback" or
                                                           vs_ideal <= 1.05)
        vs_torch = paired_band(lambda a, b: a / b, s.samples_ms, st["torch_ddp"].samples_ms)
        kw.update(judge_target((kw["vs_torch_ddp"], vs_torch, bar), *(
            [] if label == "loopback" else [(vs_ideal, _vs_ideal_band(st, s), 1.05)])))
        kw["target"] = f"<= {bar}x torch_ddp" + ("" if label == "loopback" else
                                                ", <= 1.05x ideal")
    return kw


def _missing_rows(suite: str, case: str, res: dict, label: str) -> list[dict]:
    """One ``unavailable`` row per variant that could not be built, with its error."""
    return [row(suite, case, name, status="unavailable", reason=why, net=label)
            for name, why in (res.get("missing") or {}).items()]


def _ddp_rows(res: dict, case: str, label: str, reason: str) -> list[dict]:
    st: dict[str, Stats] = res["stats"]
    med = {n: s.median_ms for n, s in st.items()}
    fwd, opt, comm = med["fwd_alone"], med["opt_alone"], med["comm_alone"]
    bwd = med["fwd_bwd_alone"] - fwd
    ideal = fwd + max(bwd, comm) + opt
    parts = fwd + bwd + comm + opt  # every part alone, one after the other
    check = _vs_parts(st, parts)  # do they add up to no_overlap's step?
    rows = []
    for name, s in st.items():
        kw = _rowkw(res, name, label, reason)
        if name.endswith("_alone"):
            kw["role"] = "part"
        elif name == "no_overlap":
            kw.update(role="unfused", **check)
        else:  # only backward runs while gradients are reduced: min(bwd, comm) can hide
            kw.update(_hidden_kw(st, s, min(bwd, comm), ideal), comm_ms=comm, bwd_ms=bwd,
                      role="peer" if name == "torch_ddp" else "fused")
            if "parts_add_up" in check:  # a share from parts that do not add up is wrong
                kw["parts_add_up"] = check["parts_add_up"]
            kw.update(_ratios(name, s, st, label, kw["vs_ideal"]))
        if name == "ddp_auto":  # what it chose
            kw.update((res.get("auto") or {}).get("ddp_auto") or {})
        rows.append(row(SUITE_DDP, case, name, s, **kw))
    rows += _missing_rows(SUITE_DDP, case, res, label)
    rows.append(row(SUITE_DDP, case, "ideal", None, role="ideal", device="cpu", net=label,
                    reason="fwd + max(bwd, comm) + opt from the parts' medians",
                    bwd_ms=bwd, comm_ms=comm))
    rows[-1]["ms"] = ideal
    return rows


_ZERO_BARS = {"zero2": 1.05, "zero3": 1.25}


def _zero_rows(res: dict, case: str, label: str, reason: str) -> list[dict]:
    st: dict[str, Stats] = res["stats"]
    ddp, ddp_mem = st.get("distllm_ddp"), res["mem"].get("distllm_ddp")
    ddp_go = ddp_mem["grads"] + ddp_mem["optimizer"] if ddp_mem else None
    rows = []
    for name, s in st.items():
        kw = _rowkw(res, name, label, reason)
        kw["role"] = {"distllm_ddp": "unfused", "fsdp2": "peer"}.get(name, "fused")
        m = res["mem"].get(name)
        if m and ddp_go:
            kw["grad_opt_vs_ddp"] = (m["grads"] + m["optimizer"]) / ddp_go
        if ddp is not None:  # the ratios to distllm_ddp, where it ran
            kw["vs_ddp"] = s.median_ms / ddp.median_ms
        if name in _ZERO_BARS and ddp is not None and (name != "zero2" or
                                                       "grad_opt_vs_ddp" in kw):
            kw["meets_target"] = kw["vs_ddp"] <= _ZERO_BARS[name] and (
                name != "zero2" or kw["grad_opt_vs_ddp"] <= 0.5)
            band = paired_band(lambda a, b: a / b, s.samples_ms, ddp.samples_ms)
            mem = kw.get("grad_opt_vs_ddp")  # measured from the tensors: no spread
            kw.update(judge_target((kw["vs_ddp"], band, _ZERO_BARS[name]), *(
                [(mem, (mem, mem), 0.5)] if name == "zero2" else [])))
            kw["target"] = f"<= {_ZERO_BARS[name]}x distllm_ddp" + (
                ", <= 0.5x its grad+optimizer memory" if name == "zero2" else "")
        if name == "zero3_noprefetch" and "zero3" in st:
            kw["slower_than_prefetch"] = s.p10_ms > st["zero3"].p90_ms  # bands apart
        rows.append(row(SUITE_ZERO, case, name, s, **kw))
    return rows + _missing_rows(SUITE_ZERO, case, res, label)


def _sweep_rows(res: dict, case: str, label: str, reason: str) -> list[dict]:
    st: dict[str, Stats] = res["stats"]
    base = st["torch_ddp"].median_ms if "torch_ddp" in st else None
    return [row(SUITE_DDP, f"{case} sweep", name, s,
                vs_torch_ddp=s.median_ms / base if base else None,
                role="peer" if name == "torch_ddp" else "fused",
                **_rowkw(res, name, label, reason)) for name, s in st.items()
            ] + _missing_rows(SUITE_DDP, f"{case} sweep", res, label)
