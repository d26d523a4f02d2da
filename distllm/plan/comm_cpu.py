"""CPU seconds that a rank's collectives take on a CPU profile (gloo: its threads copy the
bytes through TCP and add them up, on the same cores as the compute).

Measured by ``distllm plan --calibrate`` as a ring in CPU time per rank: each of an
all-reduce's ``2(n-1)`` steps costs ``cpu_latency`` and every byte the rank moves
``cpu_per_byte`` (:attr:`Link.cpu_latency`, :attr:`Link.cpu_per_byte`). On this machine
(2 cores, 4 ranks, loopback) a 64 KiB all-reduce takes about 1 ms of CPU per rank and an
8 MiB one about 6.6 ms: a step of ZeRO-3 spends as much CPU in gloo's threads as a third of
its compute, which a wall-time link model cannot see when the collective overlaps compute.

Per pipeline rank and step, two sums:
  * lockstep: the TP collectives (every rank of the group waits in them) and the
    vocab-parallel loss's;
  * background: what runs while the rank computes: the data-parallel reduction (bucket by
    bucket), ZeRO-1/2's parameter all-gather, ZeRO-3's gathers and reduce-scatters per block,
    the pipeline's sends and receives, and the tied embedding's all-reduce.
The step's scalar all-reduces are latency, charged by :meth:`TimeModel.sync_time`.
"""

from __future__ import annotations

import math

from .collectives import collective_time
from .hardware import Link
from .layout import Layout

__all__ = ["collective_cpu", "rank_collective_cpu"]


def collective_cpu(kind: str, nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """CPU seconds of ``calls`` collectives (together ``nbytes``) on one rank: the ring's
    steps at ``cpu_latency`` each and its bytes at ``cpu_per_byte`` (0 on links without a
    CPU cost)."""
    if link.cpu_per_byte <= 0 and link.cpu_latency <= 0:
        return 0.0
    ring = Link(1.0 / link.cpu_per_byte if link.cpu_per_byte > 0 else math.inf,
                link.cpu_latency, tree=False)
    one = collective_time(kind, nbytes, n, ring)
    if calls <= 1 or one == 0.0:
        return one
    steps = 1 if kind == "p2p" else (2 if kind == "all_reduce" else 1) * (n - 1)
    return one + (calls - 1) * steps * link.cpu_latency


def _tp_cpu(tm, nbytes: float, lay: Layout) -> float:
    if lay.tp == 1:
        return 0.0
    link = tm._link("tp", lay)
    if lay.sequence_parallel:
        return (collective_cpu("all_gather", nbytes, lay.tp, link)
                + collective_cpu("reduce_scatter", nbytes, lay.tp, link))
    return collective_cpu("all_reduce", nbytes, lay.tp, link)


def _lockstep(tm, lay: Layout, b: int, blocks: int, has_e: bool, has_h: bool) -> float:
    """One micro-batch's TP collectives on a rank (see :meth:`TimeModel._tp_times` and
    :meth:`TimeModel._ends` for which run)."""
    if lay.tp == 1:
        return 0.0
    s = tm.shape
    tokens = b * s.seq_len
    one = _tp_cpu(tm, tm.e * tokens * s.hidden, lay)
    per_block = (6 if lay.checkpointing == "full" else 4) * one
    if not s.splits_vocab(lay.tp, lay.sequence_parallel):  # held whole: no collective
        return blocks * per_block
    # the embedding: an all-reduce in forward (under sequence parallelism a reduce-scatter
    # in forward and an all-gather in backward); the head: the same, the other way round
    out = blocks * per_block + (one if has_e else 0.0)
    if has_h:
        link = tm._link("tp", lay)
        out += one + sum(collective_cpu("all_reduce", k * 4 * tokens, lay.tp, link)
                         for k in (1, 2))
    return out


def _background(tm, lay: Layout, r: int, b: int, blocks: int, has_e: bool,
                has_h: bool) -> float:
    """A step's collectives on rank ``r`` that run while it computes."""
    s, m, rt = tm.shape, lay.micro_batches, tm.runtime
    n_params = tm.rank_params(lay)[0][r]
    out = 0.0
    if lay.dp > 1:
        link = tm._link("dp", lay)
        if lay.zero >= 3:  # per unit (each block, the embedding, the head): two gathers
            # (forward, backward) per micro-batch, but one for the unit kept gathered from
            # its forward to its backward (TimeModel.z3_kept), and a reduce-scatter
            unit = tm.rank_params(lay)[1]
            rest = max(0.0, n_params - blocks * unit)
            rs_times = 1 if rt.zero_grad_accumulation == "full" else m
            for count, n in ((blocks, unit), (1 if rest else 0, rest)):
                out += count * (
                    2 * m * collective_cpu("all_gather", n * tm.param_bytes, lay.dp, link)
                    + rs_times * collective_cpu("reduce_scatter", n * tm.grad_bytes, lay.dp,
                                                link))
            kept = tm.z3_kept(lay, blocks, has_e, has_h)
            if kept is not None:
                n = {"block": unit, "embedding": tm.end_params(lay)[0],
                     "head": tm.end_params(lay)[1]}[kept]
                out -= m * collective_cpu("all_gather", n * tm.param_bytes, lay.dp, link)
        else:
            gbytes = tm.grad_bytes * n_params
            buckets = max(1, math.ceil(gbytes / tm.bucket_bytes))
            kind = "reduce_scatter" if lay.zero >= 2 else "all_reduce"
            out += collective_cpu(kind, gbytes, lay.dp, link, calls=buckets)
            if lay.zero in (1, 2):
                pbytes = tm.param_bytes * n_params
                out += collective_cpu("all_gather", pbytes, lay.dp, link,
                                      calls=max(1, math.ceil(pbytes / tm.bucket_bytes)))
    if lay.pp > 1:
        link = tm._link("pp", lay)
        msg = tm.e * b * s.seq_len * s.hidden / (lay.tp if lay.sequence_parallel else 1)
        chunks = lay.virtual_stages
        # each micro-batch crosses every chunk boundary of this rank twice (activation
        # forward, gradient back), as a receive and as a send; the first stage's first chunk
        # receives nothing and the last stage's last chunk sends nothing
        ends = (1 if has_e else 0) + (1 if has_h else 0)
        messages = m * (4 * chunks - 2 * ends)
        out += messages * collective_cpu("p2p", msg, 2, link)
        if tm.shape.tied_embeddings and (has_e or has_h):
            words = s.vocab_rows(lay.tp, lay.sequence_parallel) * s.hidden
            link = tm.profile.link(lay.tp * lay.dp * lay.pp > tm.gpn)
            out += collective_cpu("all_reduce", tm.grad_bytes * words, 2, link)
    return out


def rank_collective_cpu(tm, lay: Layout) -> list[tuple[float, float]]:
    """(lockstep, background) CPU seconds of a step's collectives per pipeline rank."""
    s = tm.shape
    b = s.global_batch // (lay.dp * lay.micro_batches)
    out = []
    for r, (blocks, has_e, has_h) in enumerate(tm.ranks(lay.pp, lay.virtual_stages)):
        lock = lay.micro_batches * _lockstep(tm, lay, b, blocks, has_e, has_h)
        out.append((lock, _background(tm, lay, r, b, blocks, has_e, has_h)))
    return out
