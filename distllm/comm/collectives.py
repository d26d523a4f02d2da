"""Collectives every parallelism shares, written once.

- :func:`reduce_scatter`: sum-reduce-scatter of one flat tensor. Gloo's reduce-scatter is
  slower than its all-reduce of the same tensor, so on gloo it is
  :func:`reduce_scatter_by_all_reduce`; other backends (NCCL) run the collective, through
  :func:`distllm.comm.compat.reduce_scatter_into`.
- :func:`reduce_scatter_by_all_reduce`: the all-reduce of the whole input, of which each
  rank keeps its slice, on any backend.
- :func:`broadcast_from`: a broadcast whose source is named by its rank *within* the group
  (torch's ``src`` is a global rank).

Each returns, with ``async_op=True``, a handle with ``wait()`` and ``is_completed()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from distllm.comm.compat import reduce_scatter_into

__all__ = ["reduce_scatter", "reduce_scatter_by_all_reduce", "broadcast_from"]


class _SliceOnWait:
    """The all-reduce of ``inp`` in flight; :meth:`wait` copies this rank's slice to ``out``."""

    def __init__(self, work: Work, out: torch.Tensor, inp: torch.Tensor, lo: int) -> None:
        self.work, self.out, self.inp, self.lo = work, out, inp, lo
        self.done = False

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            n = self.out.numel()
            self.out.view(-1).copy_(self.inp.view(-1)[self.lo: self.lo + n])
            self.done = True
        return True


def _check_sizes(out: torch.Tensor, inp: torch.Tensor, world: int) -> None:
    if inp.numel() != world * out.numel():
        raise ValueError(f"reduce-scatter over {world} ranks: inp has {inp.numel()} elements, "
                         f"out {out.numel()}; inp must hold {world} * out.numel() (pad it)")


def reduce_scatter_by_all_reduce(out: torch.Tensor, inp: torch.Tensor,
                                 group: ProcessGroup | None = None,
                                 async_op: bool = False) -> _SliceOnWait | None:
    """Sum ``inp`` over ``group`` with an all-reduce and copy slice ``r`` (of ``world``
    equal slices of the flattened input) into ``out`` on rank ``r``: the result of a
    reduce-scatter. ``inp`` (contiguous) is overwritten with the full sum. Returns a handle
    when ``async_op`` (``out`` is written by its ``wait()``), else ``None``."""
    world = dist.get_world_size(group)
    _check_sizes(out, inp, world)
    lo = dist.get_rank(group) * out.numel()
    handle = _SliceOnWait(dist.all_reduce(inp, group=group, async_op=True), out, inp, lo)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | _SliceOnWait | None:
    """Sum-reduce-scatter ``inp`` (``world * out.numel()`` elements, contiguous) over
    ``group``: rank ``r`` receives slice ``r`` in ``out``. On gloo
    :func:`reduce_scatter_by_all_reduce` (which overwrites ``inp``), elsewhere the backend's
    collective. Returns the handle when ``async_op``, else ``None``."""
    if dist.get_backend(group) == "gloo":
        return reduce_scatter_by_all_reduce(out, inp, group, async_op)
    _check_sizes(out, inp, dist.get_world_size(group))
    return reduce_scatter_into(out, inp, group=group, async_op=async_op)


def broadcast_from(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """Overwrite ``tensor`` on every rank of ``group`` with its value on the rank whose rank
    within ``group`` is ``src_group_rank``. Returns the handle when ``async_op``."""
    return dist.broadcast(tensor, group=group, group_src=src_group_rank, async_op=async_op)
