"""Alpha-beta time of the collectives the cost model charges (NCCL's algorithm choice)."""

from __future__ import annotations

import math

from .hardware import Link

__all__ = ["collective_time"]


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Alpha-beta time of one collective of ``nbytes`` (the full buffer) over ``n`` ranks.

    ring all-reduce 2(n-1) steps of nbytes/n; tree all-reduce 2*log2(n) latencies and 2x the
    bytes (pipelined); the cheaper of the two is taken, as NCCL does. reduce-scatter and
    all-gather are half a ring all-reduce. p2p is one message.
    """
    if n <= 1 and kind != "p2p":
        return 0.0
    a, b = link.latency, link.beta
    if kind == "p2p":
        return a + nbytes * b
    ring_half = (n - 1) * a + (n - 1) / n * nbytes * b
    if kind in ("reduce_scatter", "all_gather"):
        return ring_half
    if kind == "all_reduce":
        if not link.tree:
            return 2 * ring_half
        tree = 2 * math.ceil(math.log2(n)) * a + 2 * nbytes * b
        return min(2 * ring_half, tree)
    raise ValueError(f"unknown collective {kind!r}")
