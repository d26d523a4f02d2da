"""The layouts a search considers, and the reason each that cannot run is rejected before
it is costed.

tp divides the GPU count, stays inside a node and divides heads, KV heads, FFN and hidden;
pp divides what is left, and pp*v is at most the pieces the runtime cuts the model into
(distllm: the embedding, each block and the head, uneven chunks allowed; a runtime that
splits the blocks evenly: the blocks); dp is the
rest and divides the global batch; micro-batch counts divide the per-replica batch; the
ZeRO stages, schedules (interleaved with every v up to :data:`MAX_V`), checkpointing modes
and sequence parallelism (tp > 1) that the runtime has (:class:`Runtime`). Pins (``--tp``,
``--zero``, ...) fix a field.
"""

from __future__ import annotations

import math

from .cost import Layout
from .model import ModelShape
from .runtime import Runtime

__all__ = ["MAX_V", "check_cluster", "check_pins", "divisors", "layouts"]

MAX_V = 8


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order (up to its square root and their partners:
    a cluster of 10**12 GPUs is a million steps, not a trillion)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def _tp_reason(shape: ModelShape, tp: int, gpn: int, world: int) -> str | None:
    """Why ``tp`` cannot run, or None. TP groups are ``tp`` consecutive ranks, ``gpn`` to a
    node: a group spans two nodes where it is larger than the devices of a node in play
    (``min(gpn, world)``: fewer devices than a node's are all on one) or where a node
    boundary falls inside one (tp does not divide a whole node)."""
    node = min(gpn, world)
    if tp > node or node % tp:
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
    shape: ModelShape, pp: int, m: int, pins: dict, even: bool, schedules: tuple[str, ...]
) -> list[tuple[str, int, str | None]]:
    """(schedule, v, reason-or-None) for one (pp, m), with the runtime's pipeline rules
    (``even``: the blocks must divide evenly over the ``pp * v`` chunks; ``schedules``: the
    ones it has)."""
    if pp == 1:
        return [("none", 1, None)]
    out = []
    for sch in schedules:
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


def layouts(shape: ModelShape, world: int, gpn: int, pins: dict, rt: Runtime):
    """Yield (Layout, reason-or-None) for every combination the runtime ``rt`` has, by its
    rules (:attr:`Runtime.stage_split`, :attr:`Runtime.zb_h1_resident`)."""
    even = rt.stage_split == "blocks"
    B = shape.global_batch
    for tp in divisors(world):
        if pins.get("tp") and tp != pins["tp"]:
            continue
        treason = _tp_reason(shape, tp, gpn, world)
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
            yield from _inner(shape, tp, pp, dp, B // dp, pins, rt)


def _inner(shape: ModelShape, tp: int, pp: int, dp: int, per_replica: int, pins: dict,
           rt: Runtime):
    even, zb_resident = rt.stage_split == "blocks", rt.zb_h1_resident
    zeros = [pins["zero"]] if pins.get("zero") is not None else list(rt.zero_stages)
    ms = [pins["micro_batches"]] if pins.get("micro_batches") else divisors(per_replica)
    cks = [pins["checkpointing"]] if pins.get("checkpointing") else list(rt.checkpointing)
    sp_ok = rt.sequence_parallel and tp > 1 and shape.seq_len % tp == 0
    sps = [False, True] if sp_ok else [False]
    if pins.get("sequence_parallel") is not None and (tp > 1 or pins["sequence_parallel"]):
        sps = [pins["sequence_parallel"]]
    # pinned on where it cannot run: kept, with the trainer's reason (at tp=1 it would run
    # without: a pin is a requirement)
    spreason = (
        "sequence parallelism needs tp > 1" if True in sps and tp == 1
        else f"sequence parallelism needs --seq-len {shape.seq_len} divisible by --tp {tp}: "
        f"change --seq-len"
        if True in sps and shape.seq_len % tp
        else None
    )
    for m in ms:
        mreason = (
            None
            if per_replica % m == 0
            else (f"micro_batches={m} does not divide the {per_replica} sequences per DP replica")
        )
        for sch, v, sreason in _schedules(shape, pp, m, pins, even, rt.schedules):
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


def check_cluster(world: int, gpn: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"gpus={world!r}: give --gpus as a positive integer")
    if not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"gpus_per_node={gpn!r}: give --gpus-per-node as a positive integer")
    if world > gpn and world % gpn:
        raise ValueError(
            f"gpus={world} is not a whole number of nodes of {gpn}: choose --gpus "
            f"as a multiple of --gpus-per-node, or change --gpus-per-node"
        )


def check_pins(world: int, pins: dict, world_flag: str = "--gpus") -> None:
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
    _check_unused_pins(world, pinned, pins, world_flag)


def _check_unused_pins(world: int, pinned: dict, pins: dict, world_flag: str) -> None:
    """A ``--schedule`` where every layout left has pp = 1, or ``--sequence-parallel on``
    where every one has tp = 1: refused (the trainer refuses them), not planned without."""
    for knob, flag, given, what in (
        ("pp", "--schedule", pins.get("schedule"), "orders a pipeline's micro-batches"),
        ("tp", "--sequence-parallel", "on" if pins.get("sequence_parallel") else None,
         "shards activations inside a TP group"),
    ):
        if given is None:
            continue
        others = {k: v for k, v in pinned.items() if k != knob}
        if knob in pinned:
            most, why = pinned[knob], f"--{knob} {pinned[knob]}"
        else:
            most = world // math.prod(others.values())
            on = " x ".join(f"--{k} {v}" for k, v in others.items())
            why = f"{on} on {world_flag} {world}" if on else f"{world_flag} {world}"
        if most == 1:
            # (distllm train's --sequence-parallel is a switch: no "on" after it)
            said = flag if knob == "tp" and world_flag != "--gpus" else f"{flag} {given}"
            raise ValueError(f"{said} {what}, and {why} leaves {knob}=1: raise "
                             f"--{knob}, or drop {flag}")
