"""What DDP and ZeRO share about their replicas: the DP group of a mesh and the broadcast
from DP rank 0 that makes every replica start from the same weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from distllm.comm.collectives import broadcast_from
from distllm.parallel.mesh import ParallelDims

__all__ = ["dp_group_of", "broadcast_from_dp0"]


def dp_group_of(dims: ParallelDims | None):
    """The DP process group of ``dims`` (``None`` when there is no DP, i.e. dp == 1)."""
    if dims is None:
        raise ValueError("dims=None: pass a distllm.ParallelDims (e.g. ParallelDims(tp=1, pp=1))")
    if not hasattr(dims, "dp_group"):
        raise ValueError(f"dims={dims!r} has no dp_group: pass a distllm.ParallelDims")
    return dims.dp_group if dims.dp > 1 else None


@torch.no_grad()
def broadcast_from_dp0(tensors: Iterable[Tensor], dims: ParallelDims) -> None:
    """Overwrite ``tensors`` (parameters, buffers) on every DP rank with DP rank 0's values.
    Collective over the DP group of ``dims``: one broadcast per tensor, in the given order."""
    for t in tensors:
        broadcast_from(t.data, 0, dims.dp_group)
