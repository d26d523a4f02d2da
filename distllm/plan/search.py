"""Enumerate every layout of a model on a cluster, reject the invalid and the too-big, rank.

The search space: tp dividing the GPU count, inside a node, dividing heads/KV heads/FFN; pp
dividing what is left; dp the rest, dividing the global batch; micro-batch counts dividing
the per-replica batch; ZeRO 0-3; every schedule (interleaved with every v up to ``MAX_V``);
checkpointing none/selective/full; sequence parallelism when tp>1. The pp*v pipeline chunks
are at most the pieces the runtime cuts the model into (distllm: the embedding, each block
and the head, uneven chunks allowed; a runtime that splits the blocks evenly: the blocks).
Every layout that fails a check is kept with its reason. The rest are ranked by predicted
step time: by the closed forms of :mod:`distllm.plan.bubble`, then, when the pipeline
simulator is available, the leading ``exact`` by the simulator: every layout whose lower bound
(:meth:`TimeModel.pipeline_bound`) could beat the ``exact``-th simulated time is re-timed, so
the first ``exact`` of the ranking are the fastest by the simulator, in its order, and more
memory never makes the pick slower.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from distllm.models.gpt import CHECKPOINTING

from .bubble import SCHEDULES, simulator_or_none
from .cost import GB, STATE_BYTES, CostModel, Estimate, Layout, state_bytes, training_dtype
from .hardware import Profile, load_profile
from .model import ModelShape

__all__ = ["SearchResult", "search", "best_layout", "divisors", "MAX_V"]

MAX_V = 8
RESCORE = 8  # default: the leading layouts ranked by the simulator's step time


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    ranked: list[Estimate]
    rejected: list[Estimate] = field(default_factory=list)
    seconds: float = 0.0
    simulator: bool = False
    world_flag: str = "--gpus"  # the flag that sets the device count, for the messages
    exact: int = 0
    """The leading layouts of ``ranked`` timed by the simulator (the fastest by it, in its
    order); the rest carry the closed form's time. 0 without the simulator: all closed form."""
    simulated: int = 0
    """Layouts the simulator re-timed to find them."""

    n_rejected: int | None = None
    """How many were rejected (``len(rejected)`` unless the search kept only a summary)."""
    closest: list[Estimate] = field(default_factory=list)
    """The rejected ones that say why nothing fits: the smallest of those too big, and one
    per reason (the first few), kept whether or not ``rejected`` is."""

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


def _tp_reason(shape: ModelShape, tp: int, gpn: int) -> str | None:
    if tp > gpn or gpn % tp:
        return f"tp={tp} crosses the node boundary ({gpn} GPUs per node)"
    for knob, v in (
        ("heads", shape.heads),
        ("kv_heads", shape.n_kv_heads),
        ("ffn", shape.ffn),
        ("hidden", shape.hidden),
    ):
        if v % tp:
            return f"tp={tp} does not divide {knob}={v}"
    return None


def _schedules(
    shape: ModelShape, pp: int, m: int, pins: dict, even: bool
) -> list[tuple[str, int, str | None]]:
    """(schedule, v, reason-or-None) for one (pp, m), with the runtime's pipeline rules
    (``even``: the blocks must divide evenly over the ``pp * v`` chunks)."""
    if pp == 1:
        return [("none", 1, None)]
    out = []
    for sch in SCHEDULES:
        if pins.get("schedule") and sch != pins["schedule"]:
            continue
        if sch == "interleaved-1f1b":
            depth = _depth(shape, even)
            vs = [
                v
                for v in range(2, MAX_V + 1)
                if pp * v <= depth and not (even and shape.layers % (pp * v))
            ]
            if not vs:
                out.append((sch, 2, f"interleaving needs pp*v = {2 * pp} pipeline chunks, "
                                    f"more than {_depth_text(shape, even)}"))
            for v in vs:
                r = None if m % pp == 0 else f"{sch} needs micro_batches={m} divisible by pp={pp}"
                out.append((sch, v, r))
            continue
        r = f"{sch} needs micro_batches={m} >= pp={pp}" if sch != "gpipe" and m < pp else None
        out.append((sch, 1, r))
    return out


def _depth(shape: ModelShape, even: bool) -> int:
    """The most pipeline chunks (pp*v) the runtime can cut the model into: the trainer's
    ``layers + 2`` pieces (embedding, blocks, head: ``distllm.train.config.check_layout``),
    or the blocks alone for a runtime that splits only those (``even``)."""
    return shape.layers if even else shape.layers + 2


def _depth_text(shape: ModelShape, even: bool) -> str:
    if even:
        return f"layers={shape.layers} (this runtime splits the blocks alone)"
    return (f"the model's {shape.layers + 2} pipeline layers (embedding, {shape.layers} "
            "blocks, head)")


def _zb_h1_reason(schedule: str, zero: int, checkpointing: str) -> str | None:
    """Why a runtime that keeps zb-h1's W pass resident (:attr:`Runtime.zb_h1_resident`)
    cannot run this combination, or None."""
    if schedule != "zb-h1":
        return None
    if zero == 3:
        return "zb-h1 with zero=3: its deferred weight gradients need the released parameters"
    if checkpointing != "none":
        return (f"zb-h1 with checkpointing={checkpointing}: its deferred weight gradients do not "
                "survive recomputation")
    return None


def _enumerate(shape: ModelShape, world: int, gpn: int, pins: dict, even: bool = False,
               zb_resident: bool = False):
    """Yield (Layout, reason-or-None) for every combination (``even``, ``zb_resident``: the
    runtime's rules, :attr:`Runtime.stage_split` and :attr:`Runtime.zb_h1_resident`)."""
    B = shape.global_batch
    for tp in divisors(world):
        if pins.get("tp") and tp != pins["tp"]:
            continue
        treason = _tp_reason(shape, tp, gpn)
        for pp in divisors(world // tp):
            if pins.get("pp") and pp != pins["pp"]:
                continue
            dp = world // (tp * pp)
            if pins.get("dp") and dp != pins["dp"]:
                continue
            base = Layout(tp, pp, dp)
            reason = treason
            if reason is None and pp > _depth(shape, even):
                reason = f"pp={pp} is more stages than {_depth_text(shape, even)}"
            if reason is None and even and shape.layers % pp:
                reason = f"pp={pp} does not divide layers={shape.layers} (this runtime's split)"
            if reason is None and B % dp:
                reason = f"global batch {B} is not divisible by dp={dp}"
            if reason is not None:
                yield base, reason
                continue
            yield from _inner(shape, tp, pp, dp, B // dp, pins, even, zb_resident)


def _inner(
    shape: ModelShape, tp: int, pp: int, dp: int, per_replica: int, pins: dict, even: bool,
    zb_resident: bool = False,
):
    zeros = [pins["zero"]] if pins.get("zero") is not None else [0, 1, 2, 3]
    ms = [pins["micro_batches"]] if pins.get("micro_batches") else divisors(per_replica)
    cks = [pins["checkpointing"]] if pins.get("checkpointing") else list(CHECKPOINTING)
    sps = [False, True] if tp > 1 and shape.seq_len % tp == 0 else [False]
    if pins.get("sequence_parallel") is not None and tp > 1:
        sps = [pins["sequence_parallel"]]
    # pinned on where it cannot run: kept, with the trainer's reason
    spreason = (
        f"--sequence-parallel on needs seq_len={shape.seq_len} divisible by tp={tp}"
        if True in sps and shape.seq_len % tp
        else None
    )
    for m in ms:
        mreason = (
            None
            if per_replica % m == 0
            else (f"micro_batches={m} does not divide the {per_replica} sequences per DP replica")
        )
        for sch, v, sreason in _schedules(shape, pp, m, pins, even):
            for zero in zeros:
                zreason = (
                    f"zero={zero} with dp=1 shards nothing (use zero=0)"
                    if zero and dp == 1
                    else None
                )
                for ck in cks:
                    wreason = _zb_h1_reason(sch, zero, ck) if zb_resident else None
                    for sp in sps:
                        lay = Layout(tp, pp, dp, zero, sch, m, ck, sp, v)
                        yield lay, spreason or mreason or sreason or zreason or wreason


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
    runtime_name: str = "distllm",
    world_flag: str = "--gpus",
    exact: int = RESCORE,
) -> SearchResult:
    """Every layout of ``shape`` on ``world`` devices, ranked by predicted step time, as
    the training code ``runtime_name`` (:mod:`distllm.plan.runtime`) would run them.
    ``world_flag``: the flag the messages name for the device count (``distllm train
    --plan auto``: ``--nproc``); ``exact``: how many leading layouts the simulator ranks
    (where it runs; see the module's docstring)."""
    t0 = time.perf_counter()
    prof = load_profile(profile)
    gpn = min(prof.gpus_per_node, world) if gpus_per_node is None else gpus_per_node
    _check_cluster(world, gpn)
    pins = dict(pins or {})
    _check_pins(world, pins, world_flag)
    dtype = dtype or ("float32" if prof.cores else "bfloat16")
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
    # the replay overlaps transfers with compute: only for a runtime whose transfers do
    sim = simulator_or_none() if use_simulator and cm.runtime.p2p_async else None
    cap = prof.usable_bytes
    ranked, rejected = [], []
    even = cm.runtime.stage_split == "blocks"
    closest = _Closest()  # why nothing fits, whether or not every rejection is kept
    for lay, reason in _enumerate(shape, world, gpn, pins, even, cm.runtime.zb_h1_resident):
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
    n_exact = n_sim = 0
    if sim is not None and ranked:
        ranked, n_sim = _retime(cm, ranked, sim, max(1, exact))
        n_exact = min(max(1, exact), len(ranked))
    return SearchResult(ranked, rejected, time.perf_counter() - t0, sim is not None,
                        world_flag, n_exact, n_sim, closest.n, closest.kept())


def _rank_key(e: Estimate) -> tuple[float, float]:
    return e.step_time_s, e.memory["total"]


def _retime(cm: CostModel, ranked: list[Estimate], sim, exact: int
            ) -> tuple[list[Estimate], int]:
    """``ranked`` (closed-form times) with its ``exact`` fastest by the simulator first, in
    its order, and how many layouts were simulated. Layouts are simulated in the order of
    their lower bounds (the step with :meth:`TimeModel.pipeline_bound` for its pipeline)
    until the next bound exceeds the ``exact``-th simulated time: none left could beat it.
    The closed form is not a bound either way that this could rely on; the lower bound is."""
    bounds = sorted(
        (e.step_time_s - e.time["pipeline"] + cm.pipeline_bound(e.layout), i)
        for i, e in enumerate(ranked)
    )
    cm.simulator = sim
    times: list[float] = []
    timed: dict[int, Estimate] = {}
    for low, i in bounds:
        if len(times) >= exact and low > times[exact - 1] * (1 + 1e-12):
            break
        est = cm.evaluate(ranked[i].layout)
        timed[i] = est
        bisect.insort(times, est.step_time_s)
    cm.simulator = None
    out = [timed.get(i, e) for i, e in enumerate(ranked)]
    return sorted(out, key=_rank_key), len(timed)


def _too_big(mem: dict[str, float], prof: Profile) -> str:
    return (
        f"needs {mem['total'] / GB:.1f} GB of the {prof.memory_bytes / GB:.3g} GB "
        f"({prof.usable_bytes / GB:.1f} GB usable)"
    )


def _check_cluster(world: int, gpn: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"gpus={world!r}: give --gpus as a positive integer")
    if not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"gpus_per_node={gpn!r}: give --gpus-per-node as a positive integer")
    if world > gpn and world % gpn:
        raise ValueError(
            f"gpus={world} is not a whole number of nodes of {gpn}: choose --gpus "
            f"as a multiple of --gpus-per-node, or change --gpus-per-node"
        )


def _check_pins(world: int, pins: dict, world_flag: str = "--gpus") -> None:
    """The pinned tp/pp/dp must split ``world`` devices: name the flag that does not (else
    the search has no layout to reject and cannot say why)."""
    pinned = {k: pins[k] for k in ("tp", "pp", "dp") if pins.get(k)}
    for k, v in pinned.items():
        if world % v:
            choose = ", ".join(map(str, divisors(world)))
            raise ValueError(
                f"--{k} {v} does not divide {world_flag} {world}: choose --{k} from {choose}"
            )
    prod = math.prod(pinned.values())
    flags = " x ".join(f"--{k} {v}" for k, v in pinned.items())
    if len(pinned) > 1 and world % prod:
        raise ValueError(f"{flags} = {prod} does not divide {world_flag} {world}: change one of "
                         f"them")
    if len(pinned) == 3 and prod != world:
        raise ValueError(
            f"{flags} = {prod} is not {world_flag} {world}: drop --dp or make tp*pp*dp = "
            f"{world_flag.lstrip('-')}"
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
        f"optimizer {mem['optimizer'] / GB:.3g}, activations {mem['activations'] / GB:.3g}",
        f"  {len(res.ranked)} layouts fit, {len(res.rejected)} rejected; searched in "
        f"{res.seconds:.2f} s"
        + (f" (the first {res.exact} ranked by the pipeline simulator, {res.simulated} "
           "layouts re-timed by it; the rest by the closed form)" if res.exact else ""),
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
    dtype: str = "bfloat16",
) -> list[Estimate]:
    """Model-state memory per device of a bare parameter count under each ZeRO stage."""
    if not n_params > 0 or not math.isfinite(n_params):
        raise ValueError(f"params={n_params!r}: give --params as a positive count, e.g. 7.5e9")
    _check_cluster(world, world)
    for knob, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{knob}={v!r}: it must be a positive integer")
    if world % (tp * pp):
        raise ValueError(f"gpus={world} is not divisible by tp*pp={tp * pp}: change --tp/--pp")
    prof = load_profile(profile)
    dp = world // (tp * pp)
    dt = training_dtype(dtype)
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
