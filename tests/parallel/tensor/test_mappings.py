"""The tensor-parallel mappings on 2 and 4 gloo ranks, in float64: each public wrapper's
forward and backward against the result computed here from every rank's tensors (each rank
regenerates its peers' inputs from their seeds), the upstream gradient left untouched; the
identities at one rank and the errors that name tp. One spawn per world size, each mapping
its own test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distllm.parallel.tensor import mappings as M
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64: sums over tp <= 4 terms in another order
DT = torch.float64


def _rnd(shape, rank: int, salt: int) -> torch.Tensor:
    """Rank ``rank``'s tensor number ``salt``: the same on whichever rank makes it."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g, dtype=DT)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _check(fn, x: torch.Tensor, want_y: torch.Tensor, g: torch.Tensor,
           want_grad: torch.Tensor) -> dict[str, float]:
    """``y = fn(x)``, then ``y.backward(g)``: errors of ``y``, of ``x.grad``, and how far the
    upstream gradient ``g`` moved."""
    x = x.detach().clone().requires_grad_()
    g_before = g.clone()
    y = fn(x)
    y.backward(g)
    return {"fwd": _err(y, want_y), "bwd": _err(x.grad, want_grad), "g": _err(g, g_before)}


def _cases() -> dict:
    group = dist.group.WORLD
    tp, r = dist.get_world_size(), dist.get_rank()
    b, s, h = 2, 3 * tp, 5 * tp
    ranks = range(tp)

    def each(shape, salt):  # every rank's tensor number salt
        return [_rnd(shape, q, salt) for q in ranks]

    def copy_to():
        xs, gs = each((b, s, h), 1), each((b, s, h), 2)
        return _check(lambda x: M.copy_to_tp_region(x, group), xs[r], xs[r], gs[r], sum(gs))

    def reduce_from():
        xs, gs = each((b, s, h), 3), each((b, s, h), 4)
        return _check(lambda x: M.reduce_from_tp_region(x, group), xs[r], sum(xs), gs[r], gs[r])

    def scatter_last():
        x, gs = _rnd((b, s, h), 0, 5), each((b, s, h // tp), 6)  # x: the same on every rank
        return _check(lambda x: M.scatter_to_tp_region(x, group), x, x.chunk(tp, -1)[r],
                      gs[r], torch.cat(gs, -1))

    def gather_last():
        xs, gs = each((b, s, h // tp), 7), each((b, s, h), 8)
        return _check(lambda x: M.gather_from_tp_region(x, group), xs[r], torch.cat(xs, -1),
                      gs[r], gs[r].chunk(tp, -1)[r])

    def scatter_seq():
        x, gs = _rnd((b, s, h), 0, 9), each((b, s // tp, h), 10)
        return _check(lambda x: M.scatter_to_sequence_parallel_region(x, group), x,
                      x.chunk(tp, 1)[r], gs[r], torch.cat(gs, 1))

    def gather_seq(reduce_grad: bool, batch: int = b):
        xs, gs = each((batch, s // tp, h), 11), each((batch, s, h), 12)
        want = (sum(gs) if reduce_grad else gs[r]).chunk(tp, 1)[r]
        return _check(lambda x: M.gather_from_sequence_parallel_region(x, group, reduce_grad),
                      xs[r], torch.cat(xs, 1), gs[r], want)

    def reduce_scatter_seq(batch: int = b, transposed: bool = False):
        xs, gs = each((batch, s, h), 13), each((batch, s // tp, h), 14)
        x = xs[r]
        if transposed:  # a non-contiguous input with the same values
            x = x.transpose(0, 2).contiguous().transpose(0, 2)
        return _check(lambda x: M.reduce_scatter_to_sequence_parallel(x, group), x,
                      sum(xs).chunk(tp, 1)[r], gs[r], torch.cat(gs, 1))

    def sync_grad():
        p, cs = _rnd((3, 5), 0, 15), each((3, 5), 16)
        return _check(lambda p: M.sync_grad_over_tp(p, group), p, p, cs[r], sum(cs))

    return {
        "copy_to_tp_region": copy_to,
        "reduce_from_tp_region": reduce_from,
        "scatter_to_tp_region": scatter_last,
        "gather_from_tp_region": gather_last,
        "scatter_to_sequence_parallel_region": scatter_seq,
        "gather_from_sequence_parallel_region": lambda: gather_seq(True),
        "gather_from_sequence_parallel_region-batch1": lambda: gather_seq(True, batch=1),
        "gather_from_sequence_parallel_region-split-grad": lambda: gather_seq(False),
        "reduce_scatter_to_sequence_parallel": reduce_scatter_seq,
        "reduce_scatter_to_sequence_parallel-batch1": lambda: reduce_scatter_seq(batch=1),
        "reduce_scatter_to_sequence_parallel-non-contiguous": lambda: reduce_scatter_seq(
            transposed=True),
        "sync_grad_over_tp": sync_grad,
    }


def mappings_main() -> dict:
    return run_cases(_cases())


CASES = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
         "gather_from_tp_region", "scatter_to_sequence_parallel_region",
         "gather_from_sequence_parallel_region", "gather_from_sequence_parallel_region-batch1",
         "gather_from_sequence_parallel_region-split-grad",
         "reduce_scatter_to_sequence_parallel", "reduce_scatter_to_sequence_parallel-batch1",
         "reduce_scatter_to_sequence_parallel-non-contiguous", "sync_grad_over_tp"]


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [2, 4])
def test_mapping_forward_and_backward(spawned, tp, case):
    for rank, errs in enumerate(case_of(spawned(mappings_main, tp), case)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_identities_at_one_rank():
    x = torch.randn(2, 3, 4)
    for fn in (M.copy_to_tp_region, M.reduce_from_tp_region, M.scatter_to_tp_region,
               M.gather_from_tp_region, M.scatter_to_sequence_parallel_region,
               M.gather_from_sequence_parallel_region, M.reduce_scatter_to_sequence_parallel,
               M.sync_grad_over_tp):
        assert fn(x, None) is x, fn.__name__


def _errors_main() -> dict:
    group, out = dist.group.WORLD, {}
    for name, fn in (("split", lambda: M.scatter_to_sequence_parallel_region(
                          torch.zeros(1, 3, 2, requires_grad=True), group)),
                     ("reduce_scatter", lambda: M.reduce_scatter_dim(torch.zeros(5, 2), 0,
                                                                      group)),
                     ("none", lambda: M.reduce_from_tp_region(torch.zeros(2), None))):
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_errors_name_tp(spawned):
    for msgs in spawned(_errors_main, 2):
        assert msgs["split"] == "dimension 1 of size 3 is not divisible by tp=2"
        assert msgs["reduce_scatter"] == "dimension 0 of size 5 is not divisible by tp=2"
        # with a process group up, None would be the whole world: refused, not an identity
        assert msgs["none"] == ("the tensor-parallel mappings take the tensor-parallel group "
                                "explicitly (ParallelDims.tp_group); got None")


def _shard_is_its_own_main() -> dict:
    """A sequence shard at batch 1 (a contiguous slice of the input) modified in place: with
    autograd, and under no_grad, where it must not write into the caller's tensor."""
    out = {}
    for batch in (1, 2):
        x = torch.arange(batch * 4 * 3, dtype=DT).reshape(batch, 4, 3).requires_grad_()
        y = M.scatter_to_sequence_parallel_region(x, dist.group.WORLD)
        y.mul_(2)
        y.sum().backward()
        out[("grad", batch)] = _err(x.grad, torch.full_like(x, 2.0))  # all-gathered: 2s
        with torch.no_grad():
            x0 = x.detach().clone()
            M.scatter_to_sequence_parallel_region(x.detach(), dist.group.WORLD).zero_()
            out[("input", batch)] = _err(x.detach(), x0)
    return out


def test_a_sequence_shard_is_a_tensor_of_its_own(spawned):
    for rank, r in enumerate(spawned(_shard_is_its_own_main, 2)):
        assert r == {(k, b): 0.0 for k in ("grad", "input") for b in (1, 2)}, (rank, r)
