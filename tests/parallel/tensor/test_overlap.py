"""The overlap engines on 2 and 4 gloo ranks, in float64: each engine at every chunk count
(more chunks than rows included) against its sequential schedule, and each against the
dense result computed from every rank's input; the row pieces of a schedule; the CUDA path
(communication stream + events) on a 1-rank NCCL group. One spawn per world size, each
engine and shape its own test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distllm.parallel.tensor.overlap import (
    ENGINES,
    CommContext,
    chunk_bounds,
    pipeline_bounds,
    run_engine,
)
from distllm.testing import run_distributed
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64: sums over K <= 64 terms in a different order, ~1e-15 each
DT = torch.float64
CHUNKS = (1, 2, 3, 4, 9)
SHAPES = {  # name: (engine, shape of its input; tp stands for the world size)
    "all_reduce-7x5": ("all_reduce", (7, 5)),
    "all_reduce-1x5": ("all_reduce", (1, 5)),
    "all_reduce-769x5": ("all_reduce", (769, 5)),
    "all_gather-2x3x5": ("all_gather", (2, 3, 5)),
    "all_gather-1x123x5": ("all_gather", (1, 123, 5)),
    "reduce_scatter-2x3tpx5": ("reduce_scatter", (2, "3tp", 5)),
    "reduce_scatter-1x123tpx5": ("reduce_scatter", (1, "123tp", 5)),
}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _engine_case(comm: CommContext, mm, kind: str, shape: tuple) -> dict[str, float]:
    """Every chunk count against the sequential schedule; ``then`` runs and returns."""
    tp = comm.world
    shape = tuple(int(d[:-2]) * tp if isinstance(d, str) else d for d in shape)
    a = torch.randn(*shape, dtype=DT)
    ref, _ = run_engine(kind, a, mm, 6, comm, 0)
    ref = ref[1] if kind == "all_gather" else ref
    errs = {}
    for chunks in CHUNKS:
        out, extra = run_engine(kind, a, mm, 6, comm, chunks, then=lambda: 42)
        out = out[1] if kind == "all_gather" else out
        errs[f"c={chunks}"] = _err(out, ref) if extra == 42 else float("inf")
    for chunks, growth in ((3, 1.5), (4, 0.5)):  # geometric schedules (overlap="auto")
        out, _ = run_engine(kind, a, mm, 6, comm, chunks, then=lambda: 42, growth=growth)
        errs[f"c={chunks} g={growth}"] = _err(out[1] if kind == "all_gather" else out, ref)
    return errs


def engines_main() -> dict:
    comm = CommContext(dist.group.WORLD)
    torch.manual_seed(1 + comm.rank)  # different data per rank: the collective matters
    w = torch.randn(6, 5, dtype=DT)

    def mm(a, o):
        torch.mm(a, w.t(), out=o)

    def versus_sum():  # the all-reduce engine equals a dense sum over ranks
        a = torch.randn(7, 5, dtype=DT)
        got, _ = run_engine("all_reduce", a, mm, 6, comm, 3)
        full = a @ w.t()
        dist.all_reduce(full)
        return {"vs sum": _err(got, full)}

    def gathered(a: torch.Tensor) -> list[torch.Tensor]:  # every rank's a
        parts = [torch.empty_like(a) for _ in range(comm.world)]
        dist.all_gather(parts, a)
        return parts

    def reduce_scatter_vs_sum():  # rows [r*s/tp, (r+1)*s/tp) of the sum over ranks
        a = torch.randn(2, 3 * comm.world, 5, dtype=DT)
        got, _ = run_engine("reduce_scatter", a, mm, 6, comm, 2)
        full = sum(gathered(a @ w.t())).chunk(comm.world, 1)[comm.rank]  # w differs per rank
        return {"vs sum": _err(got, full)}

    def all_gather_vs_concat():  # every rank's sequence shard, in rank order
        a = torch.randn(2, 3, 5, dtype=DT)
        (a_full, got), _ = run_engine("all_gather", a, mm, 6, comm, 2)
        full = torch.cat(gathered(a), 1)
        return {"gathered": _err(a_full, full), "product": _err(got, full @ w.t())}

    cases = {name: (lambda k=k, s=s: _engine_case(comm, mm, k, s))
             for name, (k, s) in SHAPES.items()}
    cases["all_reduce-vs-sum"] = versus_sum
    cases["reduce_scatter-vs-sum"] = reduce_scatter_vs_sum
    cases["all_gather-vs-concat"] = all_gather_vs_concat
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


@pytest.mark.parametrize("case", [*SHAPES, "all_reduce-vs-sum", "reduce_scatter-vs-sum",
                                  "all_gather-vs-concat"])
@pytest.mark.parametrize("tp", [2, 4])
def test_engine_matches_sequential(spawned, tp, case):
    for rank, errs in enumerate(case_of(spawned(engines_main, tp), case)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_unknown_engine_names_the_choices():
    with pytest.raises(ValueError, match="use one of"):
        run_engine("broadcast", torch.zeros(2, 2), None, 2, None, 0)
    assert set(ENGINES) == {"all_reduce", "all_gather", "reduce_scatter"}


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(5, 1) == [(0, 5)]
    # the engines' pieces: the first and the last half the size of the others
    assert [e - s for s, e in pipeline_bounds(2048, 4)] == [341, 683, 683, 341]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 21, 123, 769])
def test_pipeline_bounds(n):
    # every row once, none empty, as many pieces as asked (at most one per row)
    for c in (1, 2, 3, 4, 8, 64):
        b = pipeline_bounds(n, c)
        assert b[0][0] == 0 and b[-1][1] == n and len(b) == min(n, c)
        assert all(e > s for s, e in b)
        assert all(x[1] == y[0] for x, y in zip(b[:-1], b[1:], strict=True))


def _cuda_engines():
    """The CUDA path (communication stream + events) on a 1-rank NCCL group."""
    group = dist.new_group(ranks=[0], backend="nccl")
    comm = CommContext(group)
    torch.manual_seed(0)
    w = torch.randn(96, 80, device="cuda", dtype=DT)
    mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
    errs = {}
    for kind, shape in (("all_reduce", (123, 80)), ("all_gather", (2, 37, 80)),
                        ("reduce_scatter", (2, 37, 80))):
        a = torch.randn(*shape, device="cuda", dtype=DT)
        ref = F.linear(a, w)
        for chunks in (0, 1, 3, 4):
            out, extra = run_engine(kind, a, mm, 96, comm, chunks, then=a.sum)
            out = out[1] if kind == "all_gather" else out
            torch.cuda.synchronize()
            errs[f"{kind} c={chunks}"] = _err(out.cpu(), ref.cpu())
            errs[f"{kind} c={chunks} then"] = _err(extra.cpu(), a.sum().cpu())
    return errs


@pytest.mark.gpu
def test_engines_on_cuda_streams():
    errs = run_distributed(_cuda_engines, 1, timeout=120)[0]
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, bad
