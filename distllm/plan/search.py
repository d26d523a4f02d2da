"""Every layout of a model on a cluster (:mod:`distllm.plan.space`), with the invalid and
the too-big rejected and the rest ranked.

Every layout that fails a check is kept with its reason. The rest are ranked by predicted
step time: by the closed forms of :mod:`distllm.plan.bubble`, then, when the pipeline
simulator is available, the leading ``exact`` by the simulator: every layout whose lower bound
(:meth:`TimeModel.pipeline_bound`) could beat the ``exact``-th simulated time is re-timed, so
the first ``exact`` of the ranking are the fastest by the simulator, in its order, and more
memory never makes the pick slower. A layout the simulator declines (more than
:data:`~distllm.plan.bubble.SIM_MAX_ACTIONS` actions) keeps the closed form's time, and the
leading rows are then called simulator-ranked (``SearchResult.exact``) only while their time
is below every declined layout's lower bound.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from .bubble import clear_replays, simulator_or_none
from .cost import GB, STATE_BYTES, CostModel, Estimate, Layout, state_bytes, training_dtype
from .hardware import Profile, load_profile
from .layout import grad_buffers_text
from .model import ModelShape
from .runtime import Runtime
from .space import MAX_V, check_cluster, check_pins, divisors, layouts

__all__ = ["SearchResult", "search", "best_layout", "default_dtype", "divisors", "MAX_V"]

RESCORE = 8  # default: the leading layouts ranked by the simulator's step time


def default_dtype(profile: str | Profile) -> str:
    """The training dtype when ``--dtype`` is not given: float32 on a CPU profile (one with
    ``cores``), else bfloat16."""
    return "float32" if load_profile(profile).cores else "bfloat16"


@dataclass
class SearchResult:
    ranked: list[Estimate]
    rejected: list[Estimate] = field(default_factory=list)
    seconds: float = 0.0
    simulator: bool = False
    world_flag: str = "--gpus"  # the flag that sets the device count, for the messages
    exact: int = 0
    """The leading layouts of ``ranked`` timed by the simulator (the fastest by it, in its
    order); the rest carry the closed form's time. 0 without the simulator (all closed form),
    or where a layout it declined could be faster than the first."""
    simulated: int = 0
    """Layouts the simulator re-timed to find them."""

    n_rejected: int | None = None
    """How many were rejected (``len(rejected)`` unless the search kept only a summary)."""
    closest: list[Estimate] = field(default_factory=list)
    """The rejected ones that say why nothing fits: the smallest of those too big, and one
    per reason (the first few), kept whether or not ``rejected`` is."""
    declined: int = 0
    """Layouts the simulator was asked to re-time and declined (more actions than
    :data:`~distllm.plan.bubble.SIM_MAX_ACTIONS`): they keep the closed form's time."""

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            n = len(self.rejected) if self.n_rejected is None else self.n_rejected
            raise ValueError(_nothing_fits(self.closest or self.rejected, self.world_flag, n))
        return self.ranked[0]


class _Closest:
    """The rejected layouts that say why nothing fits, without keeping every one."""

    def __init__(self) -> None:
        self.n, self.small, self.by_reason = 0, None, {}

    def add(self, e: Estimate) -> None:
        self.n += 1
        if e.memory and "GB" in (e.rejected_reason or ""):
            if self.small is None or e.memory["total"] < self.small.memory["total"]:
                self.small = e
        elif len(self.by_reason) < 3:
            self.by_reason.setdefault(e.rejected_reason, e)

    def kept(self) -> list[Estimate]:
        return ([self.small] if self.small else []) + list(self.by_reason.values())


def _nothing_fits(rejected: list[Estimate], world_flag: str = "--gpus",
                  n: int | None = None) -> str:
    n = len(rejected) if n is None else n
    mem = [e for e in rejected if e.memory and "GB" in (e.rejected_reason or "")]
    if mem:
        low = min(mem, key=lambda e: e.memory["total"])
        why = f"the smallest, {low.layout.name()}, {low.rejected_reason}"
    else:
        reasons = list(dict.fromkeys(e.rejected_reason for e in rejected))
        why = "; ".join(r for r in reasons[:3] if r) or "nothing to search"
    grow = ("add devices (--gpus), use a bigger device (--gpu)" if world_flag == "--gpus"
            else f"add ranks ({world_flag})")
    return (
        f"no layout fits ({n} rejected; {why}): change the pinned dimensions, "
        f"{grow}, or shrink --global-batch/--seq-len"
    )


def search(
    shape: ModelShape,
    world: int,
    gpus_per_node: int | None = None,
    profile: str | Profile = "a100-80gb",
    *,
    dtype: str | None = None,
    pins: dict | None = None,
    flash_attention: bool = True,
    use_simulator: bool = True,
    keep_rejected: bool = True,
    ranks_per_host: int | None = None,
    runtime_name: str | Runtime = "distllm",
    world_flag: str = "--gpus",
    exact: int = RESCORE,
) -> SearchResult:
    """Every layout of ``shape`` on ``world`` devices, ranked by predicted step time, as
    the training code ``runtime_name`` (:mod:`distllm.plan.runtime`) would run them.
    ``world_flag``: the flag the messages name for the device count (``distllm train
    --plan auto``: ``--nproc``); ``exact``: how many leading layouts the simulator ranks
    (where it runs; see the module's docstring)."""
    try:
        return _search(shape, world, gpus_per_node, profile, dtype, pins, flash_attention,
                       use_simulator, keep_rejected, ranks_per_host, runtime_name, world_flag,
                       exact)
    finally:
        clear_replays()


def _search(shape, world, gpus_per_node, profile, dtype, pins, flash_attention, use_simulator,
            keep_rejected, ranks_per_host, runtime_name, world_flag, exact) -> SearchResult:
    t0 = time.perf_counter()
    prof = load_profile(profile)
    gpn = min(prof.gpus_per_node, world) if gpus_per_node is None else gpus_per_node
    check_cluster(world, gpn)
    pins = dict(pins or {})
    check_pins(world, pins, world_flag)
    dtype = dtype or default_dtype(prof)
    cm = CostModel(
        shape,
        prof,
        world,
        gpn,
        dtype=dtype,
        flash_attention=flash_attention,
        ranks_per_host=ranks_per_host,
        runtime_name=runtime_name,
    )
    cm.runtime.check_pins(pins)  # a pin of what the runtime does not have: refused
    # the replay overlaps transfers with compute: only for a runtime whose transfers do
    sim = simulator_or_none() if use_simulator and cm.runtime.p2p_async else None
    cap = prof.usable_bytes
    ranked, rejected = [], []
    closest = _Closest()  # why nothing fits, whether or not every rejection is kept
    for lay, reason in layouts(shape, world, gpn, pins, cm.runtime):
        mem = {} if reason is not None else cm.memory(lay)
        if reason is None and mem["total"] > cap:
            reason = _too_big(mem, prof)
        if reason is not None:
            e = Estimate(lay, memory=mem, rejected_reason=reason)
            closest.add(e)
            if keep_rejected:
                rejected.append(e)
            continue
        ranked.append(cm.evaluate(lay))
    ranked.sort(key=_rank_key)
    n_exact = n_sim = n_declined = 0
    if sim is not None and ranked:
        ranked, n_exact, n_sim, n_declined = _retime(cm, ranked, sim, max(1, exact))
    return SearchResult(ranked, rejected, time.perf_counter() - t0, sim is not None,
                        world_flag, n_exact, n_sim, closest.n, closest.kept(), n_declined)


def _rank_key(e: Estimate) -> tuple[float, float]:
    return e.step_time_s, e.memory["total"]


def _retime(cm: CostModel, ranked: list[Estimate], sim, exact: int
            ) -> tuple[list[Estimate], int, int, int]:
    """``ranked`` (closed-form times) with its fastest by the simulator first, in its order;
    how many of them lead the ranking (at most ``exact``), how many layouts were simulated,
    and how many the simulator declined (too many actions, a case it refuses: they keep the
    closed form's time). Layouts are simulated in the order of their lower bounds (the step
    with :meth:`TimeModel.pipeline_bound` for its pipeline) until the next bound exceeds the
    ``exact``-th simulated time: none left could beat it. The closed form is not a bound
    either way that this could rely on; the lower bound is. A leading layout counts as
    ranked by the simulator only while its time is below the bound of every declined one."""
    bounds = sorted(
        (e.step_time_s - e.time["pipeline"] + cm.pipeline_bound(e.layout), i)
        for i, e in enumerate(ranked)
    )
    declined: dict[int, float] = {}  # index -> its lower bound
    at: list[tuple[int, float]] = []  # the layout being timed

    def replay(*args):
        got = sim(*args)
        if got is None:
            declined[at[-1][0]] = at[-1][1]
        return got

    cm.simulator = replay
    times: list[float] = []
    timed: dict[int, Estimate] = {}
    try:
        for low, i in bounds:
            if len(times) >= exact and low > times[exact - 1] * (1 + 1e-12):
                break
            at.append((i, low))
            est = cm.evaluate(ranked[i].layout)
            if i in declined:  # its closed form again: no simulated time to rank by
                continue
            timed[i] = est
            bisect.insort(times, est.step_time_s)
    finally:
        cm.simulator = None
    order = sorted(range(len(ranked)), key=lambda i: _rank_key(timed.get(i, ranked[i])))
    floor = min(declined.values(), default=math.inf)
    lead = 0
    for i in order[:exact]:
        if i not in timed or timed[i].step_time_s > floor:
            break
        lead += 1
    return [timed.get(i, ranked[i]) for i in order], lead, len(timed), len(declined)


def _too_big(mem: dict[str, float], prof: Profile) -> str:
    need, usable = mem["total"] / GB, prof.usable_bytes / GB
    # as many decimals as it takes for the need to read above what is usable (up to 6)
    d = next((d for d in range(1, 7) if round(need, d) > round(usable, d)), 6)
    return (
        f"needs {need:.{d}f} GB of the {prof.memory_bytes / GB:.3g} GB "
        f"({usable:.{d}f} GB usable)"
    )


def explain(est: Estimate, shape: ModelShape, res: SearchResult) -> str:
    lay, t, mem = est.layout, est.time, est.memory
    lines = [
        f"chose {lay.name()} for {shape.name} on {lay.tp * lay.pp * lay.dp} devices: "
        f"predicted {est.step_time_s:.4g} s/step, MFU {est.mfu:.1%}, "
        f"{mem['total'] / GB:.2f} GB per device",
        f"  time: compute {t['compute']:.4g} s, pipeline {t['pipeline']:.4g} s "
        f"(tp comm {t['tp_comm']:.3g}, dp comm exposed {t['dp_comm']:.3g}, zero comm "
        f"{t['zero_comm']:.3g}, optimizer {t['optimizer']:.3g})",
        f"  memory: params {mem['params'] / GB:.3g} GB, grads {mem['grads'] / GB:.3g}, "
        f"optimizer {mem['optimizer'] / GB:.3g}, activations {mem['activations'] / GB:.3g}"
        + grad_buffers_text(mem),
        f"  {len(res.ranked)} layouts fit, {len(res.rejected)} rejected; searched in "
        f"{res.seconds:.2f} s"
        + (f" (the first {res.exact} ranked by the pipeline simulator, {res.simulated} "
           "layouts re-timed by it; the rest by the closed form)" if res.exact else "")
        + (f"; {res.declined} layouts too large for the simulator kept the closed form's time"
           if res.declined else ""),
    ]
    if len(res.ranked) > 1:
        nxt = res.ranked[1]
        lines.append(
            f"  runner-up {nxt.layout.name()}: {nxt.step_time_s:.4g} s/step "
            f"({nxt.step_time_s / est.step_time_s - 1:+.1%})"
        )
    return "\n".join(lines)


def best_layout(
    model_shape: ModelShape | str,
    world_size: int,
    gpus_per_node: int | None = None,
    profile: str | Profile = "cpu",
    *,
    dtype: str | None = None,
    pins: dict | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    **kw,
) -> tuple[Layout, str]:
    """The fastest layout that fits, and a few lines saying why (for ``--plan auto``).

    ``model_shape`` is a :class:`ModelShape` or a preset name; ``global_batch``/``seq_len``
    override its batch and sequence; ``pins`` fixes dimensions (``{"zero": 1}``). Pure
    arithmetic: no torch.distributed, no processes; a 1024-device search takes seconds.
    Raises ValueError (saying why) when no layout fits.
    """
    from .model import preset

    shape = preset(model_shape) if isinstance(model_shape, str) else model_shape
    over = {k: v for k, v in (("global_batch", global_batch), ("seq_len", seq_len)) if v}
    shape = shape.with_(**over) if over else shape
    res = search(shape, world_size, gpus_per_node, profile, dtype=dtype, pins=pins, **kw)
    best = res.best
    return best.layout, explain(best, shape, res)


def model_states_table(
    n_params: float,
    world: int,
    tp: int = 1,
    pp: int = 1,
    profile: str | Profile = "a100-80gb",
    dtype: str | None = None,
) -> list[Estimate]:
    """Model-state memory per device of a bare parameter count under each ZeRO stage
    (``dtype``: the search's default, :func:`default_dtype`, unless given)."""
    if not n_params > 0 or not math.isfinite(n_params):
        raise ValueError(f"params={n_params!r}: give --params as a positive count, e.g. 7.5e9")
    check_cluster(world, world)
    for knob, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{knob}={v!r}: it must be a positive integer")
    if world % (tp * pp):
        raise ValueError(f"gpus={world} is not divisible by tp*pp={tp * pp}: change --tp/--pp")
    prof = load_profile(profile)
    dp = world // (tp * pp)
    dt = training_dtype(dtype or default_dtype(prof))
    out = []
    for zero in range(4):
        lay = Layout(tp, pp, dp, zero)
        # the ZeRO paper's accounting: 16-bit gradients under mixed precision
        mem = state_bytes(n_params / (tp * pp), dp, zero, STATE_BYTES[dt])
        mem["activations"] = 0.0
        mem["total"] = sum(mem.values())
        est = Estimate(lay, memory=mem)
        if mem["total"] > prof.usable_bytes:
            est.rejected_reason = _too_big(mem, prof)
        out.append(est)
    return out
