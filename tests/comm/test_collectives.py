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


def _outcome(fn, *args, **kw) -> str:
    """What ``fn(*args, **kw)`` raised, as ``"Type: message"``, or "no error"."""
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the type is part of the outcome
        return f"{type(e).__name__}: {e}"
    return "no error"


def _follow_up_errors(big: int) -> list[float]:
    """An all-reduce, a pairwise all-gather and a reduce-scatter, each against its exact
    result: a message left in flight by an earlier call would be taken by one of them."""
    from distllm.comm.collectives import all_gather, all_reduce, reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(rank + 1), dtype=torch.float64)
    all_reduce(t)
    g = torch.full((world * big,), float("nan"), dtype=torch.float64)
    all_gather(g, torch.full((big,), float(rank), dtype=torch.float64))
    r = torch.full((N,), float("nan"), dtype=torch.float64)
    reduce_scatter(r, _inp(rank, world))
    total = sum(_inp(q, world) for q in range(world))
    return [(t - world * (world + 1) / 2).abs().max().item(),
            (g - torch.arange(world).repeat_interleave(big)).abs().max().item(),
            (r - total[rank * N: (rank + 1) * N]).abs().max().item()]


def misuse_main() -> dict:
    from distllm.comm import collectives as coll

    rank, world = dist.get_rank(), dist.get_world_size()
    big = coll.PAIRWISE_MIN_BYTES // 8 + 3  # float64 elements: the pairwise all-gather
    f32, f64 = torch.float32, torch.float64
    rs_inp = _inp(rank, world)
    cases = {
        "ag_dtype": (coll.all_gather, torch.empty(world * N, dtype=f32),
                     torch.zeros(N, dtype=f64)),
        "ag_dtype_big": (coll.all_gather, torch.empty(world * big, dtype=f32),
                         torch.zeros(big, dtype=f64)),
        "ag_dtype_pairwise": (coll.all_gather_pairwise, torch.empty(world * N, dtype=f32),
                              torch.zeros(N, dtype=f64)),
        "ag_device": (coll.all_gather, torch.empty(world * big, dtype=f64, device="meta"),
                      torch.zeros(big, dtype=f64)),
        "rs_dtype": (coll.reduce_scatter, torch.empty(N, dtype=f32), rs_inp),
        # (world, N) viewed from (N, world): slices of it are strided
        "rs_inp": (coll.reduce_scatter, torch.empty(N, dtype=f64),
                   rs_inp.view(N, world).t()),
        "rs_inp_pairwise": (coll.reduce_scatter_pairwise, torch.empty(N, dtype=f64),
                            rs_inp.view(N, world).t()),
        "rs_inp_by_all_reduce": (coll.reduce_scatter_by_all_reduce, torch.empty(N, dtype=f64),
                                 rs_inp.view(N, world).t()),
        "rs_out": (coll.reduce_scatter, torch.empty(N, 2, dtype=f64)[:, 0], rs_inp),
    }
    out = {}
    for name, (fn, res, inp) in cases.items():
        out[name] = _outcome(fn, res, inp)
        out[name, "after"] = _follow_up_errors(big)
    return out


def test_misuse_raises_before_posting():
    """A dtype, device or layout the collective cannot take is a ValueError on every rank
    before any message is posted; the collectives after it get their exact results."""
    dtype_msg = ("ValueError: {}: out is torch.float32, inp torch.float64; allocate out with "
                 "dtype=torch.float64 (nothing is converted)")
    want = {
        "ag_dtype": dtype_msg.format("all-gather"),
        "ag_dtype_big": dtype_msg.format("all-gather"),
        "ag_dtype_pairwise": dtype_msg.format("all-gather"),
        "ag_device": "ValueError: all-gather: out is on meta, inp on cpu; allocate out on cpu",
        "rs_dtype": dtype_msg.format("reduce-scatter"),
        "rs_out": "ValueError: reduce-scatter: out is not contiguous; pass a contiguous out "
                  "(torch.empty) and copy it where it belongs after",
    }
    for name in ("rs_inp", "rs_inp_pairwise", "rs_inp_by_all_reduce"):
        want[name] = "ValueError: reduce-scatter: inp is not contiguous; pass inp.contiguous()"
    for rank, r in enumerate(run_distributed(misuse_main, 2, timeout=120)):
        for name, msg in want.items():
            assert r[name] == msg, (rank, name, r[name])
            assert r[name, "after"] == [0.0, 0.0, 0.0], (rank, name, r[name, "after"])


def requires_grad_main() -> dict:
    from distllm.comm import collectives as coll

    rank, world = dist.get_rank(), dist.get_world_size()
    big = coll.PAIRWISE_MIN_BYTES // 8 + 3
    res = {}
    for op, want in ((dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.MAX, 2.0)):
        for async_op in (False, True):
            t = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
            _call(coll.all_reduce, t, async_op=async_op, op=op)
            res["all_reduce", op == dist.ReduceOp.MAX, async_op] = (
                (t.detach() - want).abs().max().item(), t.requires_grad, t.is_leaf, t.grad)
    total = sum(_inp(q, world) for q in range(world))
    for name in ("reduce_scatter_pairwise", "reduce_scatter_by_all_reduce"):
        for async_op in (False, True):
            o = torch.zeros(N, dtype=torch.float64, requires_grad=True)
            inp = _inp(rank, world).requires_grad_(name == "reduce_scatter_pairwise")
            _call(getattr(coll, name), o, inp, async_op=async_op)
            res[name, async_op] = ((o.detach() - total[rank * N: (rank + 1) * N]).abs().max()
                                   .item(), o.requires_grad, o.is_leaf, o.grad)
    for async_op in (False, True):
        g = torch.zeros(world * big, dtype=torch.float64, requires_grad=True)
        mine = torch.full((big,), float(rank), dtype=torch.float64, requires_grad=True)
        _call(coll.all_gather_pairwise, g, mine, async_op=async_op)
        res["all_gather_pairwise", async_op] = (
            (g.detach() - torch.arange(world).repeat_interleave(big)).abs().max().item(),
            g.requires_grad, g.is_leaf, g.grad)
    return res


def test_tensors_that_require_grad():
    """Leaf tensors that require grad are written as torch.distributed writes them: values
    exact, still leaves that require grad, no gradient."""
    for rank, r in enumerate(run_distributed(requires_grad_main, 2, timeout=120)):
        assert len(r) == 2 * 2 + 2 * 2 + 2, sorted(r)
        for key, got in r.items():
            assert got == (0.0, True, True, None), (rank, key, got)


def nan_bits_main() -> dict:
    from distllm.comm.collectives import all_reduce

    rank = dist.get_rank()
    res = {}
    # NaNs of both signs and several payloads, each element a different pairing; 37 elements
    # run through the vectorized body and the scalar tail of the add
    for dtype, itype, quiet, sign in ((torch.float64, torch.int64, 0x7FF8 << 48, -1 << 63),
                                      (torch.float32, torch.int32, 0x7FC0 << 16, -1 << 31)):
        i = torch.arange(37)
        payload = (i * 3 + rank) % 5 + 1
        negative = (i + rank) % 2 == 0
        bits = torch.where(negative, quiet + sign, quiet) + payload  # (37,)
        t = bits.to(itype).view(dtype)
        all_reduce(t)
        res[str(dtype)] = (t.isnan().all().item(), t.view(itype).tolist())
    return res


def test_sum_exchange_nan_bits_agree():
    """The 2-rank SUM exchange of two NaNs of different sign and payload gives both ranks the
    same bits (both add rank 0's operand to rank 1's)."""
    a, b = run_distributed(nan_bits_main, 2, timeout=120)
    for dtype in ("torch.float64", "torch.float32"):
        assert a[dtype][0] and b[dtype][0], dtype
        assert a[dtype][1] == b[dtype][1], (dtype, a[dtype][1], b[dtype][1])


def shapes_and_completion_main() -> dict:
    from distllm.comm.collectives import all_gather, reduce_scatter_by_all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    # below the pairwise size the backend's all-gather runs: a (3, 2) inp into a flat out of
    # world * 6 elements, as the docstring allows
    inp = torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank
    flat = torch.full((world * 6,), float("nan"), dtype=torch.float64)
    all_gather(flat, inp)
    res["ag_2d"] = flat.tolist()
    res["ag_out"] = _error_of(all_gather, torch.empty(world * 6, 2, dtype=torch.float64)[:, 0],
                              inp)
    # the reduce-scatter by all-reduce: once the handle reports completion (polled, or its
    # future), this rank's slice is in out
    total = sum(_inp(r, world) for r in range(world))
    want = total[rank * N: (rank + 1) * N]
    for how in ("poll", "future"):
        out = torch.full((N,), float("nan"), dtype=torch.float64)
        h = reduce_scatter_by_all_reduce(out, _inp(rank, world), async_op=True)
        if how == "poll":
            while not h.is_completed():
                pass
        else:
            assert h.get_future().wait() == [out]
        res[how] = (out - want).abs().max().item()
        h.wait()
    return res


def test_gather_shapes_and_the_slice_handle_completion():
    for rank, r in enumerate(run_distributed(shapes_and_completion_main, 2, timeout=120)):
        assert r["ag_2d"] == [float(v) for v in range(6)] + [float(v + 10) for v in range(6)]
        assert r["ag_out"] == ("all-gather: out is not contiguous; pass a contiguous out "
                               "(torch.empty) and copy it where it belongs after"), r["ag_out"]
        assert r["poll"] == 0.0 and r["future"] == 0.0, (rank, r)


def test_a_slice_handle_found_complete_waits_its_collective():
    """A reduce-scatter by all-reduce found complete by polling (the gradient buckets poll)
    copies its slice and waits the collective all the same: on NCCL torch keeps the
    collective's tensors (a whole bucket) until a wait, and the later wait() of the handle
    returned early without one."""
    from distllm.comm.collectives import _SliceOnWait

    class Done:
        waits = 0

        def is_completed(self):
            return True

        def wait(self):
            Done.waits += 1
            return True

    out, inp = torch.zeros(2), torch.arange(4.0)
    h = _SliceOnWait(Done(), out, inp, 2)
    assert h.is_completed() and out.tolist() == [2.0, 3.0]
    assert h.wait() and Done.waits == 1
