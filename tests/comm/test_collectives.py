"""The shared collectives on 2 and 4 gloo ranks: each reduce-scatter path against the sum
computed here (integer-valued float64, so exact), sync and async, what each leaves in its
input, and the broadcast from a rank named within a subgroup."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distllm.testing import run_distributed

N = 7  # elements each rank receives: odd


def _inp(rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s input, ``world * N`` integer-valued elements (sums are exact)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-50, 50, (world * N,), generator=g).to(torch.float64)


def collectives_main() -> dict:
    from distllm.comm.collectives import (
        broadcast_from,
        reduce_scatter,
        reduce_scatter_by_all_reduce,
        reduce_scatter_pairwise,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    total = sum(_inp(r, world) for r in range(world))
    want = total[rank * N: (rank + 1) * N]
    out = {}
    paths = {"auto": reduce_scatter, "pairwise": reduce_scatter_pairwise,
             "by_all_reduce": reduce_scatter_by_all_reduce}
    for name, fn in paths.items():
        for async_op in (False, True):
            res = torch.full((N,), float("nan"), dtype=torch.float64)
            inp = _inp(rank, world)
            h = fn(res, inp, dist.group.WORLD, async_op=async_op)
            if async_op:
                h.wait()
                assert h.is_completed()
            else:
                assert h is None
            out[(name, async_op)] = (res - want).abs().max().item()
            # the pairwise exchange (gloo's path, CPU) only reads its input; the all-reduce
            # leaves the full sum there
            kept = total if name == "by_all_reduce" else _inp(rank, world)
            out[(name, async_op, "inp")] = (inp - kept).abs().max().item()
    try:
        reduce_scatter(torch.empty(N + 1), _inp(rank, world), dist.group.WORLD)
        out["size_error"] = "no error"
    except ValueError as e:
        out["size_error"] = str(e)
    # subgroups of 2 consecutive ranks; the source is group rank 1 (global 1, 3, ...)
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    t = torch.full((3,), float(rank), dtype=torch.float64)
    broadcast_from(t, 1, groups[rank // 2])
    out["broadcast"] = t.tolist()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_and_broadcast(world):
    for rank, r in enumerate(run_distributed(collectives_main, world, timeout=120)):
        for name in ("auto", "pairwise", "by_all_reduce"):
            for async_op in (False, True):
                for key in ((name, async_op), (name, async_op, "inp")):
                    assert r[key] == 0.0, f"rank {rank}, reduce_scatter {key}: off by {r[key]}"
        assert "(pad it)" in r["size_error"], r["size_error"]
        src = rank // 2 * 2 + 1
        assert r["broadcast"] == [float(src)] * 3, f"rank {rank}: {r['broadcast']}"
