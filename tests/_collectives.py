"""Counting the all-reduces a piece of code runs, for the tests that check which one ran."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counted_all_reduces():
    """Count every all-reduce while open: gloo's (``dist.all_reduce``), or (2 ranks, gloo,
    CPU) the exchange that replaces it, as ``(kind, numel)`` in the yielded list."""
    import torch

    from distllm.comm import collectives

    reduces: list[tuple[str, int]] = []
    all_reduce, exchange_init = torch.distributed.all_reduce, collectives._ExchangeAdd.__init__

    def counted(t, *a, **kw):
        reduces.append(("gloo", t.numel()))
        return all_reduce(t, *a, **kw)

    def counted_exchange(self, t, *a, **kw):
        reduces.append(("exchange", t.numel()))
        exchange_init(self, t, *a, **kw)

    torch.distributed.all_reduce = counted
    collectives._ExchangeAdd.__init__ = counted_exchange
    try:
        yield reduces
    finally:
        torch.distributed.all_reduce = all_reduce
        collectives._ExchangeAdd.__init__ = exchange_init
