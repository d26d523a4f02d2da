"""The DP group of a mesh and the broadcast from DP rank 0, on 4 gloo ranks as tp=2 x dp=2:
replicas that start different end equal to their own DP group's rank 0, and only that."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.parallel.data.replicas import dp_group_of
from distllm.testing import run_distributed


def replicas_main() -> dict:
    from distllm import ParallelDims
    from distllm.parallel import DistributedDataParallel
    from distllm.parallel.data.replicas import broadcast_from_dp0

    dims = ParallelDims(tp=2)  # ranks (dp, tp) = (r // 2, r % 2): DP groups {0, 2}, {1, 3}
    rank = dist.get_rank()
    a, b = torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)
    broadcast_from_dp0([a, b], dims)
    m = nn.Linear(3, 2).double()
    m.register_buffer("count", torch.full((1,), float(rank)))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(rank)
    DistributedDataParallel(m, dims=dims)
    return {"a": a.tolist(), "b": b.flatten().tolist(), "ddp": [p.flatten().tolist()
                                                             for p in m.parameters()],
            "buffer": m.count.item(), "dp1_group": dp_group_of(ParallelDims(tp=4))}


def test_broadcast_from_dp_rank0():
    for rank, r in enumerate(run_distributed(replicas_main, 4, timeout=120)):
        src = rank % 2  # the global rank of DP rank 0 in this rank's DP group
        assert r["a"] == [float(src)] * 3 and r["b"] == [10.0 + src] * 4, (rank, r)
        assert all(v == float(src) for p in r["ddp"] for v in p), (rank, r["ddp"])
        assert r["buffer"] == float(src), (rank, r["buffer"])
        assert r["dp1_group"] is None


def test_dp_group_of_names_the_knob():
    with pytest.raises(ValueError, match="dims=None: pass a distllm.ParallelDims"):
        dp_group_of(None)
    with pytest.raises(ValueError, match="has no dp_group"):
        dp_group_of(object())
