"""``overlap="auto"``: choose the chunk count of an overlap engine (or no overlap) from a
measurement on the real tensors, cached per (collective, shape, dtype, device, group).

The candidates (compute alone, the sequential schedule, then each chunk count) are timed
through :mod:`distllm.diagnostics.timing`: interleaved repetitions after a warm-up round, a
barrier over the group before each, each candidate keeping its fastest repetition
(interference from other work only ever adds time, so the minimum is the steadier estimate
of what a schedule costs), and the MAX of every rank's timings, so that all ranks choose the
same schedule (a mismatch would pair different collectives). A chunked schedule is chosen
only when it beats the sequential one by more than ``margin`` (3%); otherwise the layer
falls back to no overlap and says so once through ``logging.getLogger("distllm")``.

The cache is a measurement record (not configuration): :func:`clear_cache` empties it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distllm.diagnostics.timing import interleaved_samples, max_over_ranks, wall_timer
from distllm.parallel.tensor.overlap import CommContext, NullComm

__all__ = ["Choice", "choose", "clear_cache", "CANDIDATES"]

log = logging.getLogger("distllm")

CANDIDATES = (2, 4, 8)
_CACHE: dict[tuple, Choice] = {}


@dataclass(frozen=True)
class Choice:
    """The outcome of one measurement: ``chunks`` (0 = no overlap), the times (ms, best of
    the repetitions) of the compute alone, of the sequential schedule and of the chosen one,
    and the reason."""

    chunks: int
    compute_ms: float
    sequential_ms: float
    chosen_ms: float
    reason: str

    @property
    def comm_ms(self) -> float:
        """Standalone communication time: sequential minus compute."""
        return max(0.0, self.sequential_ms - self.compute_ms)


def clear_cache() -> None:
    """Forget every measured choice (the next call of each shape measures again)."""
    _CACHE.clear()


def _measure(run: Callable[[CommContext, int], object], comm: CommContext, rows: int,
             device: torch.device, reps: int, extra: int) -> tuple[list[str], list[float]]:
    """``(candidate names, best ms of each, MAX over the group)``; collective."""
    null = NullComm(comm)
    cands = sorted({c for c in (*CANDIDATES, extra) if 2 <= c <= rows})
    variants: dict[str, Callable[[], object]] = {
        "compute": lambda: run(null, 1),
        "sequential": lambda: run(comm, 0),
    }
    for c in cands:
        variants[str(c)] = lambda c=c: run(comm, c)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    samples = interleaved_samples(variants, warmup=1, reps=reps, timer=wall_timer(sync),
                                  before_each=lambda: dist.barrier(group=comm.group))
    names = list(samples)
    # on the group's device (NCCL takes CUDA tensors only); read back once per measurement
    return names, max_over_ranks([min(samples[n]) for n in names], comm.group, device)


def choose(key: tuple, run: Callable[[CommContext, int], object], comm: CommContext, rows: int,
           device: torch.device, what: str, chunks_hint: int = 4, reps: int = 5,
           margin: float = 0.03) -> Choice:
    """The cached :class:`Choice` for ``key``; measured on first use.

    ``run(comm, chunks)`` runs the schedule once (``chunks=0``: sequential); ``rows`` bounds
    the chunk counts tried; ``device`` is where the layer's tensors live (the timings are
    reduced over the group there; CUDA is synchronised inside each timed run); ``what``
    names the layer in the log line.
    """
    full_key = (comm.backend, comm.ranks, *key)
    if full_key in _CACHE:
        return _CACHE[full_key]
    if comm.world == 1:
        ch = Choice(0, 0.0, 0.0, 0.0, "tp=1: nothing to communicate")
    else:
        names, best_ms = _measure(run, comm, rows, device, reps, chunks_hint)
        t = dict(zip(names, best_ms, strict=True))
        chunked = {n: v for n, v in t.items() if n not in ("compute", "sequential")}
        best = min(chunked, key=chunked.get) if chunked else None
        if best is not None and t[best] < t["sequential"] * (1 - margin):
            ch = Choice(int(best), t["compute"], t["sequential"], t[best],
                        f"{best} chunks: {t[best]:.2f} ms vs sequential {t['sequential']:.2f} ms")
        else:
            why = (f"best chunked {t[best]:.2f} ms" if best else "too few rows to chunk")
            ch = Choice(0, t["compute"], t["sequential"], t["sequential"],
                        f"no overlap: {why} vs sequential {t['sequential']:.2f} ms")
            log.warning("%s %s on %s x%d: overlap falls back to none (%s)", what, key,
                        comm.backend, comm.world, ch.reason)
    _CACHE[full_key] = ch
    return ch
