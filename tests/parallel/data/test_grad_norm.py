"""``local_norm``: this rank's share of the global gradient norm, against the norm of the
pieces it must count, for both norm types and mixed dtypes; replicated pieces count on TP
rank 0 only; inf/NaN reach the result."""

from __future__ import annotations

import math
import types

import pytest
import torch

from distllm.parallel.data.grad_norm import local_norm


def _pieces():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(7, 5, generator=g, dtype=torch.float64), True),
            (torch.randn(3, generator=g, dtype=torch.float64), False),
            (torch.randn(4, 2, generator=g).to(torch.bfloat16), True),
            (torch.randn(6, generator=g), False),
            (torch.zeros(0), True)]


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_local_norm_counts_what_this_tp_rank_owns(tp_rank, norm_type):
    dims = types.SimpleNamespace(tp_rank=tp_rank, device=torch.device("cpu"))
    pieces = _pieces()
    mine = torch.cat([t.double().reshape(-1) for t, sharded in pieces
                      if sharded or tp_rank == 0])
    want = mine.square().sum() if norm_type == 2.0 else mine.abs().max()
    got = local_norm(pieces, dims=dims, norm_type=norm_type)
    assert got.dtype == torch.float64 and got.dim() == 0
    # the float32 pieces are reduced in float32: within its rounding of the total
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_local_norm_propagates_non_finite(norm_type, bad):
    pieces = _pieces()
    pieces[3][0][2] = bad
    got = local_norm(pieces, dims=None, norm_type=norm_type)
    assert not torch.isfinite(got)


def test_local_norm_of_nothing_is_a_zero_on_the_mesh_device():
    dims = types.SimpleNamespace(tp_rank=1, device=torch.device("cpu"))
    got = local_norm([(torch.zeros(0), False), (torch.zeros(0), True)], dims=dims)
    assert got.item() == 0.0 and got.dtype == torch.float64


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_replicated_piece_another_tp_rank_counts_still_carries_a_fault(norm_type, bad):
    """On TP rank 1 a replicated piece adds nothing to the norm, unless it is inf/NaN here:
    then the norm is NaN (a fault in one rank's copy reaches the norm every rank reads)."""
    dims = types.SimpleNamespace(tp_rank=1, device=torch.device("cpu"))
    ones = torch.ones(3, dtype=torch.float64)
    assert local_norm([(ones, False)], dims=dims, norm_type=norm_type).item() == 0.0
    ones[1] = bad
    assert torch.isnan(local_norm([(ones, False), (torch.ones(2), True)], dims=dims,
                                  norm_type=norm_type))


def _faults_reach_every_rank():
    """On tp=3: the inf and 2-norms of a TP-sharded gradient holding one inf/NaN on one rank
    (each rank in turn), as every rank reads them, and the clean norms."""
    from distllm import ParallelDims
    from distllm.parallel.data.grad_norm import clip_grad_norm_

    dims = ParallelDims(tp=3, pp=1, dp=1)
    out = {}
    for bad in (None, float("nan"), float("inf")):
        for at in ((0,) if bad is None else (0, 1, 2)):
            for nt in (2.0, float("inf")):
                w = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
                w.tensor_model_parallel = True
                w.grad = torch.full((4,), 0.5 + dims.tp_rank, dtype=torch.float64)
                if bad is not None and dims.tp_rank == at:
                    w.grad[1] = bad
                out[(str(bad), at, nt)] = clip_grad_norm_([w], 1e9, dims=dims, norm_type=nt).item()
    return out


def test_a_fault_on_one_of_three_ranks_reaches_every_ranks_norm():
    """gloo's ring MAX drops NaN (max(0, NaN) = 0 on 3+ ranks), so an inf-norm that a NaN on
    one rank made NaN was finite after the reduction; it must read non-finite everywhere."""
    from distllm.testing import run_distributed

    res = run_distributed(_faults_reach_every_rank, 3, timeout=120)
    for key in res[0]:
        got = [r[key] for r in res]
        bad, at, nt = key
        if bad == "None":
            want = 2.5 if nt == float("inf") else (4 * (0.5**2 + 1.5**2 + 2.5**2)) ** 0.5
            assert got == [pytest.approx(want, rel=1e-15)] * 3, (key, got)
        else:
            assert not any(map(math.isfinite, got)), (key, got)
