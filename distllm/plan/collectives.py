"""Alpha-beta time of the collectives the cost model charges (NCCL's algorithm choice), and
the fit of a link's alpha and beta to measured all-reduce times (``distllm plan
--calibrate``)."""

from __future__ import annotations

import math
import statistics

from .hardware import Link

__all__ = ["FIT", "collective_time", "fit_alpha_beta"]

FIT = ("ring fit: bandwidth from the largest size, latency from the smaller half (their "
       "median)")
"""How :func:`fit_alpha_beta` fits, as a profile's ``source`` says."""


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


def fit_alpha_beta(times: dict[int, float], n: int,
                   line_rate: float | None = None) -> tuple[float, float]:
    """(alpha, beta) of ring all-reduce times ``{bytes: seconds}`` on n ranks, the model
    ``2(n-1)*alpha + 2(n-1)/n * bytes * beta``: beta from the largest size (bandwidth-bound),
    alpha from the smaller half of the sizes (latency-bound; their median), so that the fit
    predicts the largest message no faster than it was measured, and never a bandwidth above
    ``line_rate`` (bytes/s per direction, where the link's rate is known)."""
    k, c = 2 * (n - 1), 2 * (n - 1) / n
    pts = sorted(times.items())
    big_s, big_t = pts[-1]
    small = pts[: (len(pts) + 1) // 2]
    floor = 1.0 / line_rate if line_rate else 0.0
    beta = floor
    # alpha given beta, beta given alpha, to their fixed point: the line through the largest
    # point and the small sizes' median (each round shrinks the error by their size ratio)
    for _ in range(60):
        alpha = max(0.0, statistics.median((t - c * s * beta) / k for s, t in small))
        beta = max(floor, (big_t - k * alpha) / (c * big_s))
    # all latency (the largest no slower than the small ones): a bandwidth it cannot see
    return alpha, max(beta, 1e-15)
