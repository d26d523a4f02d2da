"""``VocabParallelEmbedding`` on 2 and 4 gloo ranks in float64 against ``nn.Embedding`` with
the same table (output and the table's grad), with and without sequence parallelism; the
errors that name the knob. One spawn per world size, each scenario its own test."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.nn.embedding import VocabParallelEmbedding
from distllm.nn.parallel_linear import gather_sequence
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64: a sum of one nonzero term per token
DT = torch.float64


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def embedding_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(0)
    vocab, h = 5 * tp, 6
    emb = nn.Embedding(vocab, h, dtype=DT)
    ids = torch.randint(0, vocab, (3, 2 * tp))

    def scenario(sp: bool) -> dict[str, float]:
        emb.zero_grad()
        ref = emb(ids)
        (ref * ref).sum().backward()
        pe = VocabParallelEmbedding.from_dense(emb, dims, sequence_parallel=sp)
        y = pe(ids)
        y = gather_sequence(y, dims) if sp else y
        (y * y).sum().backward()
        return {"out": _err(y, ref), "grad": _err(pe.weight.grad, emb.weight.grad.chunk(tp, 0)[r])}

    return run_cases({"plain": lambda: scenario(False), "sp": lambda: scenario(True)})


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


@pytest.mark.parametrize("case", ["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_parity(spawned, tp, case):
    for rank, errs in enumerate(case_of(spawned(embedding_main, tp), case)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


DIMS = types.SimpleNamespace(tp=2, tp_rank=0, tp_group=None)  # no collective runs below


def test_vocabulary_not_divisible_names_the_padding():
    with pytest.raises(ValueError, match="pad the vocabulary to 12"):
        VocabParallelEmbedding(11, 4, DIMS)


def test_sequence_not_divisible_names_tp():
    emb = VocabParallelEmbedding(12, 4, DIMS, sequence_parallel=True)
    with pytest.raises(ValueError, match="multiple of tp=2"):
        emb(torch.zeros(1, 5, dtype=torch.long))
