"""Gradient buckets on their own: how parameters are grouped (no processes), and on 2 and 4
gloo ranks what each reduction leaves in place, for every mode and reduce-scatter
implementation, against the float64 average of the ranks' gradients computed here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.parallel.data.bucket_layout import FIRST_BUCKET_BYTES, assign_buckets
from distllm.parallel.data.buckets import REDUCE_SCATTER_IMPLS, GradBuckets
from tests._errors import worst
from tests._spawn import SpawnCache
from tests.parallel.data._common import TOL


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


def _params(*numels: int, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


# --- grouping ----------------------------------------------------------------------------

def test_last_parameter_first_and_small_first_bucket():
    a, b, c, d, e = _params(10, 100, 20, 300, 30)  # 40, 400, 80, 1200, 120 bytes
    got = assign_buckets([a, b, c, d, e], cap_bytes=500, first_cap_bytes=64)
    # e alone reaches the first cap; d passes the cap by itself; c + b fit in 500; a is left
    assert got == [[e], [d], [c, b], [a]]


def test_small_parameters_join_the_large_one_after_them():
    # registration order weight, bias, weight, bias: backward meets bias 2 first
    w1, b1, w2, b2 = _params(300, 3, 300, 3)  # 1200, 12, 1200, 12 bytes
    got = assign_buckets([w1, b1, w2, b2], cap_bytes=500, first_cap_bytes=500)
    # each bias shares the bucket of the weight (past the cap) after it: no bucket of 12 bytes
    assert got == [[b2, w2], [b1, w1]]
    # a bucket holding half its cap or more still closes before a parameter that would
    # pass the cap
    a, b, c = _params(70, 300, 10)  # 280, 1200, 40 bytes
    assert assign_buckets([b, a], cap_bytes=500, first_cap_bytes=500) == [[a], [b]]
    assert assign_buckets([b, c], cap_bytes=500, first_cap_bytes=500) == [[c, b]]


def test_first_bucket_closes_at_its_own_cap():
    a, b, c = _params(10, 20, 30)  # 40, 80, 120 bytes
    # c alone reaches the 100-byte first cap; b and a then share a bucket under the cap
    assert assign_buckets([a, b, c], cap_bytes=1000, first_cap_bytes=100) == [[c], [b, a]]
    assert assign_buckets([a, b, c], cap_bytes=1000, first_cap_bytes=1000) == [[c, b, a]]


def test_keys_never_share_a_bucket_and_elem_size_overrides_bytes():
    a, b = _params(10, 10, dtype=torch.float64)
    c, d = _params(10, 10, dtype=torch.float32)
    got = assign_buckets([a, c, b, d], cap_bytes=10**6, first_cap_bytes=10**6)
    assert sorted(map(len, got)) == [2, 2] and all(len({p.dtype for p in g}) == 1 for g in got)
    # two float32 params of 10 elements: 80 bytes fit a 100-byte cap; counted at 8 bytes
    # an element (a reduction in a wider dtype) they are 160 and do not
    assert assign_buckets([c, d], 100, 100) == [[d, c]]
    assert assign_buckets([c, d], 100, 100, elem_size=8) == [[d], [c]]
    assert FIRST_BUCKET_BYTES == 1024 * 1024


def test_bad_arguments_name_the_knob():
    ps = [_params(3)]
    with pytest.raises(ValueError, match="mode='sum'"):
        GradBuckets(ps, group=None, mode="sum", dtype=torch.float32, as_view=False,
                    persistent=True)
    with pytest.raises(ValueError, match="as_view=True needs persistent=True"):
        GradBuckets(ps, group=None, mode="all_reduce", dtype=torch.float32, as_view=True,
                    persistent=False)
    with pytest.raises(ValueError, match="reduce_scatter_impl='ring'"):
        GradBuckets(ps, group=None, mode="reduce_scatter", dtype=torch.float32, as_view=False,
                    persistent=False, reduce_scatter_impl="ring")


# --- reductions on gloo ranks --------------------------------------------------------------

NUMELS = (21, 5, 13, 12)  # odd sizes: buckets are padded to the group size
CASES = {f"reduce_scatter-{impl}": ("reduce_scatter", impl) for impl in REDUCE_SCATTER_IMPLS}
CASES["all_reduce"] = ("all_reduce", "auto")


def _grads(rank: int, cycle: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients in ``cycle``; on rank 0 parameter 2 gets none (unused)."""
    g = torch.Generator().manual_seed(100 * cycle + rank)
    gs = [torch.randn(n, generator=g, dtype=torch.float64) for n in NUMELS]
    if rank == 0:
        gs[2] = torch.zeros_like(gs[2])
    return gs


def _expected(buckets: list[list[nn.Parameter]], params, cycles, world: int,
              pad_to: int) -> list:
    """Per bucket: the average over ranks of the flat gradients (zero-padded to a multiple of
    ``pad_to``), summed over ``cycles``."""
    where = {id(p): i for i, p in enumerate(params)}
    out = []
    for ps in buckets:
        n = sum(p.numel() for p in ps)
        full = torch.zeros(n + (-n % pad_to), dtype=torch.float64)
        for c in cycles:
            for r in range(world):
                flat = torch.cat([_grads(r, c)[where[id(p)]] for p in ps])
                full[:n] += flat / world
        out.append(full)
    return out


def _one_cycle(gb: GradBuckets, params, cycle: int) -> None:
    rank = dist.get_rank()
    loss = sum((p * g).sum() for i, (p, g) in enumerate(zip(params, _grads(rank, cycle),
                                                          strict=True))
               if not (rank == 0 and i == 2))
    loss.backward()  # the last hook's finish() runs at the end of backward
    gb.finish()  # idempotent


def bucket_scenarios() -> dict:
    """Each case: two synchronised cycles (results accumulate), then ``zero_grad`` and a
    third cycle; the largest error against the expected average after cycle 2 and 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (mode, impl) in CASES.items():
        params = _params(*NUMELS, dtype=torch.float64)
        plists = assign_buckets(params, cap_bytes=200, first_cap_bytes=64)
        gb = GradBuckets(plists, group=dist.group.WORLD, mode=mode, dtype=torch.float64,
                         as_view=False, persistent=mode == "all_reduce",
                         reduce_scatter_impl=impl)
        errs = []
        for cycles in ([0, 1], [2]):
            if cycles == [2]:
                gb.zero_grad()
            for c in cycles:  # without zero_grad, a cycle adds to the one before
                _one_cycle(gb, params, c)
            want = _expected(plists, params, cycles, world,
                             pad_to=world if mode == "reduce_scatter" else 1)
            for b, w in zip(gb.buckets, want, strict=True):
                if mode == "reduce_scatter":
                    s = b.shard_numel
                    got, w = b.shard, w[rank * s: (rank + 1) * s]
                else:
                    got = b.buffer
                errs.append((got - w).abs().max().item())
        out[name] = {"err": worst(errs), "buckets": len(gb.buckets),
                     "freed": all(b.buffer is None for b in gb.buckets)}
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_reduction_gives_the_average(spawned, case, world):
    for r in spawned(bucket_scenarios, world):
        res = r[case]
        assert res["buckets"] >= 3, res  # several buckets, launched in order
        assert res["err"] < TOL, f"{case}: off the float64 average by {res['err']:.3g}"
        if case != "all_reduce":  # transient buffers: only the shard is kept
            assert res["freed"], res


# --- transient buffers: no zero fill, the shard reduced into (one process) -----------------

class _DirtyTorch:
    """``torch`` for the buckets module, whose ``empty`` returns NaN-filled memory (what a
    reused allocation may hold), so that a slice nobody wrote would show."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kw):
        return torch.empty(*size, **kw).fill_(float("nan"))


def _backward(params, grads) -> None:
    sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()


def test_transient_buffer_first_gradient_copied_unwritten_zeroed(monkeypatch):
    from distllm.parallel.data import buckets as mod

    monkeypatch.setattr(mod, "torch", _DirtyTorch())
    p0, p1, p2 = _params(5, 3, 3, dtype=torch.float64)  # 11 elements, padded to 12
    gb = GradBuckets([[p0, p1, p2]], group=None, mode="reduce_scatter", dtype=torch.float64,
                     as_view=False, persistent=False, pad_to=4)
    g = torch.Generator().manual_seed(0)
    a0, b0, b1 = (torch.randn(n, generator=g, dtype=torch.float64) for n in (5, 5, 3))
    with gb.no_sync():  # micro-batch 1: p0 only
        _backward([p0], [a0])
    _backward([p0, p1], [b0, b1])  # micro-batch 2 (synchronised): p2 never gets one
    [b] = gb.buckets
    want = torch.cat([a0 + b0, b1, torch.zeros(4, dtype=torch.float64)])
    assert torch.equal(b.shard, want)
    shard = b.shard
    gb.zero_grad()
    c0, c1, c2 = (torch.randn(n, generator=g, dtype=torch.float64) for n in (5, 3, 3))
    _backward([p0, p1, p2], [c0, c1, c2])
    assert b.shard is shard  # a fresh shard receives the reduction itself: no copy
    assert torch.equal(b.shard, torch.cat([c0, c1, c2, torch.zeros(1, dtype=torch.float64)]))
    _backward([p1], [c1])  # no zero_grad: the next cycle adds to the shard
    assert torch.equal(b.shard[5:8], c1 + c1) and torch.equal(b.shard[:5], c0)


def test_a_gradient_into_a_launched_bucket_is_refused_and_the_log_is_per_cycle():
    p0, p1 = _params(5, 3, dtype=torch.float64)
    gb = GradBuckets([[p0], [p1]], group=None, mode="all_reduce", dtype=torch.float64,
                     as_view=True, persistent=True, finish_on_backward_end=False)
    g = torch.Generator().manual_seed(0)
    a0, a1, b0 = (torch.randn(n, generator=g, dtype=torch.float64) for n in (5, 3, 5))
    _backward([p0, p1], [a0, a1])  # synchronised: both buckets launched, no finish() yet
    # a pass under no_sync now would add into a buffer being reduced: refused, untouched
    with gb.no_sync(), pytest.raises(RuntimeError, match="already launched"):
        _backward([p0], [b0])
    gb.finish()
    assert torch.equal(p0.grad, a0) and torch.equal(p1.grad, a1)
    for _ in range(3):  # the log holds the last cycle's launches, not every step's
        gb.zero_grad()
        _backward([p0, p1], [a0, a1])
        gb.finish()
    assert [i for i, _, _ in gb.launch_log] == [0, 1] and gb.launches_in_backward == 2
