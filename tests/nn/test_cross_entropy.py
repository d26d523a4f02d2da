"""``vocab_parallel_cross_entropy`` on 2 and 4 gloo ranks in float64 against
``F.cross_entropy`` of the gathered logits (loss and logits grad) for every reduction and
``ignore_index``, with large shifted logits; and at the end of a sequence-parallel chain
(embedding -> MLP -> column-parallel head -> loss) against the dense chain; targets outside
the vocabulary raise. One spawn per world size, each scenario its own test."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distllm.nn.cross_entropy import vocab_parallel_cross_entropy
from distllm.nn.embedding import VocabParallelEmbedding
from distllm.nn.mlp import DenseMLP, ParallelMLP
from distllm.nn.parallel_linear import ColumnParallelLinear
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64; reductions reordered over <= 64 terms
DT = torch.float64
REDUCTIONS = ("mean", "sum", "none")


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _reduction(dims, red: str) -> dict[str, float]:
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(1)
    v = 7 * tp
    logits = torch.randn(3, 5, v, dtype=DT) * 3 + 1e4  # shifted: the max must be subtracted
    tgt = torch.randint(0, v, (3, 5))
    tgt[0, 1] = tgt[2, 4] = -100
    tgt[1, 0] = 3
    ld = logits.clone().requires_grad_()
    ref = F.cross_entropy(ld.view(-1, v), tgt.view(-1), reduction=red)
    ref = ref.view(3, 5) if red == "none" else ref
    lp = logits.chunk(tp, -1)[r].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(lp, tgt, dims, reduction=red)
    w = torch.rand_like(ref)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    return {"loss": _err(got, ref), "grad": _err(lp.grad, ld.grad.chunk(tp, -1)[r])}


def _ignore_index(dims) -> dict[str, float]:
    """``ignore_index=1`` changes which tokens count."""
    tp = dims.tp
    torch.manual_seed(2)
    lp = torch.randn(3, 5, 2, dtype=DT)
    tgt = torch.randint(0, 2 * tp, (3, 5))
    gathered = [torch.empty_like(lp) for _ in range(tp)]
    dist.all_gather(gathered, lp, group=dims.tp_group)
    ref = F.cross_entropy(torch.cat(gathered, -1).view(-1, 2 * tp), tgt.view(-1), ignore_index=1)
    return {"loss": _err(vocab_parallel_cross_entropy(lp, tgt, dims, ignore_index=1), ref)}


def _masked(dims) -> dict[str, float]:
    """-inf logits (a vocabulary's padding, a banned token): a whole shard of them, and one
    at the first column of a shard that the clamped index of another shard's target reads;
    an ignored token among them. Loss and gradient equal F.cross_entropy's (no NaN)."""
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(3)
    v = 4 * tp
    logits = torch.randn(2, 3, v, dtype=DT)
    logits[..., v - 4:] = -torch.inf  # the last shard is all padding
    logits[..., 4] = -torch.inf  # the first column of shard 1
    tgt = torch.randint(0, v - 4, (2, 3)).masked_fill(torch.tensor([[1, 0, 0], [0, 0, 0]]) > 0,
                                                      -100)
    tgt[tgt == 4] = 5
    ld = logits.clone().requires_grad_()
    ref = F.cross_entropy(ld.view(-1, v), tgt.view(-1))
    ref.backward()
    lp = logits.chunk(tp, -1)[r].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(lp, tgt, dims)
    got.backward()
    return {"loss": _err(got, ref), "grad": _err(lp.grad, ld.grad.chunk(tp, -1)[r])}


def _all_ignored(dims) -> dict[str, float]:
    """Every target ignored (a fully padded micro-batch), mean: F.cross_entropy's NaN loss
    and its zero gradient, not NaN in every logit's."""
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 4 * tp, dtype=DT)
    tgt = torch.full((2, 3), -100)
    ld = logits.clone().requires_grad_()
    ref = F.cross_entropy(ld.view(-1, 4 * tp), tgt.view(-1))
    ref.backward()
    lp = logits.chunk(tp, -1)[r].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(lp, tgt, dims)
    got.backward()
    return {"loss is NaN as torch's": 0.0 if got.isnan() and ref.isnan() else 1.0,
            "grad": _err(lp.grad, ld.grad.chunk(tp, -1)[r])}


def _chain(dims) -> dict[str, float]:
    """embedding -> sequence-parallel MLP -> column-parallel head -> cross-entropy."""
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(0)
    vocab, h = 5 * tp, 6
    emb, mlp = nn.Embedding(vocab, h, dtype=DT), DenseMLP(h, 4 * tp, dtype=DT)
    head = nn.Linear(h, vocab, bias=False, dtype=DT)
    ids, tgt = torch.randint(0, vocab, (3, 2 * tp)), torch.randint(0, vocab, (3, 2 * tp))
    e = emb(ids)
    F.cross_entropy(head(e + mlp(e)).view(-1, vocab), tgt.view(-1)).backward()
    pe = VocabParallelEmbedding.from_dense(emb, dims, sequence_parallel=True)
    pm = ParallelMLP.from_dense(mlp, dims, sequence_parallel=True, overlap="chunked", chunks=3)
    ph = ColumnParallelLinear.from_dense(head, dims, sequence_parallel=True, overlap="chunked")
    e = pe(ids)
    vocab_parallel_cross_entropy(ph(e + pm(e)), tgt, dims).backward()
    return {"emb grad": _err(pe.weight.grad, emb.weight.grad.chunk(tp, 0)[r]),
            "fc2 grad": _err(pm.fc2.weight.grad, mlp.fc2.weight.grad.chunk(tp, 1)[r]),
            "head grad": _err(ph.weight.grad, head.weight.grad.chunk(tp, 0)[r])}


def cross_entropy_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    cases = {red: (lambda red=red: _reduction(dims, red)) for red in REDUCTIONS}
    cases["ignore_index=1"] = lambda: _ignore_index(dims)
    cases["-inf logits"] = lambda: _masked(dims)
    cases["all ignored"] = lambda: _all_ignored(dims)
    cases["sequence-parallel chain"] = lambda: _chain(dims)
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=180)


@pytest.mark.parametrize("case", [*REDUCTIONS, "ignore_index=1", "-inf logits", "all ignored",
                                  "sequence-parallel chain"])
@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_parity(spawned, tp, case):
    for rank, errs in enumerate(case_of(spawned(cross_entropy_main, tp), case)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_bad_reduction_names_the_knob():
    dims = types.SimpleNamespace(tp=2, tp_rank=0, tp_group=None)  # raises before any collective
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2), dims, reduction="avg")


@pytest.mark.parametrize("bad", ["V", -1, 1000])
@pytest.mark.parametrize("tp", [1, 2])
def test_targets_outside_the_vocabulary_name_its_size(tp, bad):
    """V = 3 * tp: a target not in [0, V) and not ignore_index raises before any collective
    (F.cross_entropy raises too; the gather would otherwise read a clamped logit)."""
    dims = types.SimpleNamespace(tp=tp, tp_rank=0, tp_group=None)
    v = 3 * tp
    bad = v if bad == "V" else bad
    tgt = torch.tensor([[0, -100, v - 1, bad]])
    with pytest.raises(ValueError, match=rf"targets must be in \[0, {v}\) for a vocabulary of "
                                         rf"size {v}, or equal ignore_index=-100: got {bad}"):
        vocab_parallel_cross_entropy(torch.zeros(1, 4, 3), tgt, dims)
