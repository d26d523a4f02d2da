"""The shared collectives on 2 and 4 gloo ranks: each reduce-scatter path against the sum
computed here (integer-valued float64, so exact), sync and async, what each leaves in its
input; each all-reduce path (the 2-rank exchange, on the world and on subgroups of 2);
each all-gather path against the inputs concatenated here, in place or not, on the
world and on subgroups; and the broadcast from a rank named within a subgroup."""

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


def _call(fn, *args, async_op: bool, **kw) -> str | None:
    """``fn(*args, async_op=async_op, **kw)``, waited for when async; the handle's type name
    (None when sync, which must return no handle)."""
    h = fn(*args, async_op=async_op, **kw)
    if not async_op:
        assert h is None
        return None
    h.wait()
    assert h.is_completed()
    return type(h).__name__


def _error_of(fn, *args, **kw) -> str:
    """The message of the ValueError ``fn(*args, **kw)`` raises, or "no error"."""
    try:
        fn(*args, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


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
            _call(fn, res, inp, dist.group.WORLD, async_op=async_op)
            out[(name, async_op)] = (res - want).abs().max().item()
            # the pairwise exchange (gloo's path, CPU) only reads its input; the all-reduce
            # leaves the full sum there
            kept = total if name == "by_all_reduce" else _inp(rank, world)
            out[(name, async_op, "inp")] = (inp - kept).abs().max().item()
    out["size_error"] = _error_of(reduce_scatter, torch.empty(N + 1), _inp(rank, world),
                                  dist.group.WORLD)
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


def gathers_main() -> dict:
    from distllm.comm.collectives import PAIRWISE_MIN_BYTES, all_gather, all_gather_pairwise

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    big = PAIRWISE_MIN_BYTES // 8 + 3  # float64 elements per rank: the pairwise path's size
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    for gname, group, ranks in (("world", dist.group.WORLD, list(range(world))),
                                ("pair", groups[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1])):
        me = ranks.index(rank)
        for n in (N, big):
            want = torch.cat([_inp(r, 1)[:1].repeat(n) + torch.arange(n) for r in ranks])
            for name, fn in (("auto", all_gather), ("pairwise", all_gather_pairwise)):
                for async_op in (False, True):
                    for in_place in (False, True):
                        res = torch.full((len(ranks) * n,), float("nan"), dtype=torch.float64)
                        mine = _inp(rank, 1)[:1].repeat(n) + torch.arange(n)
                        inp = res[me * n: (me + 1) * n] if in_place else mine.clone()
                        if in_place:
                            inp.copy_(mine)
                        kind = _call(fn, res, inp, group, async_op=async_op)
                        if name == "auto" and async_op:  # gloo, CPU: pairwise from big
                            out[(gname, n == big, "handle")] = kind
                        key = (gname, n == big, name, async_op, in_place)
                        out[key] = (res - want).abs().max().item()
                        out[key + ("inp",)] = (inp - mine).abs().max().item()
    out["size_error"] = _error_of(all_gather, torch.empty(world * big + 1, dtype=torch.float64),
                                  torch.zeros(big, dtype=torch.float64), dist.group.WORLD)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_paths(world):
    for rank, r in enumerate(run_distributed(gathers_main, world, timeout=120)):
        for g in ("world", "pair"):
            assert r.pop((g, True, "handle")) == "_GatherPairwise", (rank, g)
            assert r.pop((g, False, "handle")) != "_GatherPairwise", (rank, g)
        keys = [k for k in r if isinstance(k, tuple)]
        assert len(keys) == 2 * 2 * 2 * 2 * 2 * 2, sorted(keys)
        for key in keys:
            assert r[key] == 0.0, f"rank {rank}, all_gather {key}: off by {r[key]}"
        assert f"out must hold {world} * inp.numel()" in r["size_error"], r["size_error"]


def all_reduces_main() -> dict:
    import distllm.comm.collectives as coll
    from distllm.comm.collectives import all_reduce, all_reduce_exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    big = coll.PAIRWISE_MIN_BYTES // 8 + 5
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    cases = [("world", dist.group.WORLD, list(range(world))),
             ("pair", groups[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1])]
    sum_, max_ = dist.ReduceOp.SUM, dist.ReduceOp.MAX
    for gname, group, ranks in cases:
        for n in (N, big):
            vals = {r: _inp(r, 1).repeat(n)[:n] * (r + 1) for r in ranks}
            want = {sum_: sum(vals.values()),
                    max_: torch.stack(list(vals.values())).max(0).values}
            paths = [("auto", all_reduce)] + (
                [("exchange", all_reduce_exchange)] if len(ranks) == 2 else [])
            for name, fn in paths:
                for op in (sum_, max_):
                    for async_op in (False, True):
                        t = vals[rank].clone()
                        kind = _call(fn, t, group, async_op=async_op, op=op)
                        out[(gname, n == big, name, op == max_, async_op)] = (
                            (t - want[op]).abs().max().item())
                        if name == "auto" and async_op:
                            out[(gname, n == big, "handle", op == max_)] = kind
    # MAX propagates a NaN from either side, and gives both ranks the same bits (signed
    # zeros too: torch.maximum(-0., 0.) is -0., torch.maximum(0., -0.) is 0.)
    pair = cases[1][1]
    t = torch.tensor([float("nan") if rank % 2 else 1.0, 2.0 + rank,
                      -0.0 if rank % 2 else 0.0, 0.0 if rank % 2 else -0.0],
                     dtype=torch.float64)
    all_reduce(t, pair, op=max_)
    out["nan_max"] = (t[0].isnan().item(), t[1].item() - (2.0 + rank // 2 * 2 + 1))
    out["max_bits"] = t[1:].view(torch.int64).tolist()
    # the floor: below EXCHANGE_MIN_BYTES gloo's own all-reduce runs
    coll.EXCHANGE_MIN_BYTES = 1 << 40
    try:
        pair_vals = {r: _inp(r, 1).repeat(big)[:big] * (r + 1) for r in cases[1][2]}
        t = pair_vals[rank].clone()
        out["floor_handle"] = _call(all_reduce, t, pair, async_op=True)
        out["floor_err"] = (t - sum(pair_vals.values())).abs().max().item()
    finally:
        coll.EXCHANGE_MIN_BYTES = 0
    out["op_error"] = _error_of(all_reduce_exchange, torch.zeros(3, dtype=torch.float64), pair,
                                op=dist.ReduceOp.PRODUCT)
    if world != 2:
        out["world_error"] = _error_of(all_reduce_exchange,
                                       torch.zeros(big, dtype=torch.float64), dist.group.WORLD)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_paths(world):
    results = run_distributed(all_reduces_main, world, timeout=120)
    bits = [r.pop("max_bits") for r in results]
    for lo in range(0, world, 2):  # each pair of ranks reduced to the same bits
        assert bits[lo] == bits[lo + 1], bits
    for rank, r in enumerate(results):
        # the exchange wherever the group has 2 ranks (SUM and MAX, any size)
        for big in (False, True):
            for is_max in (False, True):
                assert r.pop(("pair", big, "handle", is_max)) == "_ExchangeAdd", rank
                world_kind = r.pop(("world", big, "handle", is_max))
                assert (world_kind == "_ExchangeAdd") == (world == 2), (rank, world_kind)
        assert r.pop("nan_max") == (True, 0.0), rank
        assert r.pop("floor_handle") != "_ExchangeAdd", rank
        assert r.pop("floor_err") == 0.0, rank
        assert "SUM or MAX" in r.pop("op_error"), rank
        if world != 2:
            assert "runs over 2 ranks" in r.pop("world_error"), rank
        n_paths = {2: 2, 4: 1}[world] + 2  # world (exchange only at 2) + pair (both)
        assert len(r) == n_paths * 2 * 2 * 2, sorted(r)
        for key, err in r.items():
            assert err == 0.0, f"rank {rank}, all_reduce {key}: off by {err}"
