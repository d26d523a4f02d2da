"""``VocabParallelEmbedding`` on 2 and 4 gloo ranks in float64 against ``nn.Embedding`` with
the same table (output and the table's grad), with and without sequence parallelism and
``padding_idx`` (on whichever rank holds it); the errors that name the knob (options
``from_dense`` cannot keep, token ids outside the vocabulary) and the id check's device path.
One spawn per world size, each scenario its own test."""

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

    def scenario(sp: bool, padding_idx: int | None = None) -> dict[str, float]:
        dense = emb
        if padding_idx is not None:  # the same table, the pad row trained by no token
            dense = nn.Embedding(vocab, h, padding_idx=padding_idx, dtype=DT)
            with torch.no_grad():
                dense.weight.copy_(emb.weight)
        dense.zero_grad()
        pad_ids = ids.clone()
        if padding_idx is not None:
            pad_ids[:, ::2] = dense.padding_idx  # half the tokens are padding
        ref = dense(pad_ids)
        (ref * ref).sum().backward()
        pe = VocabParallelEmbedding.from_dense(dense, dims, sequence_parallel=sp)
        y = pe(pad_ids)
        y = gather_sequence(y, dims) if sp else y
        (y * y).sum().backward()
        return {"out": _err(y, ref),
                "grad": _err(pe.weight.grad, dense.weight.grad.chunk(tp, 0)[r]),
                "pad": float(pe.padding_idx != dense.padding_idx)}

    per = vocab // tp
    return run_cases({
        "plain": lambda: scenario(False),
        "sp": lambda: scenario(True),
        # rank 1's row 2; rank 1's row 0 (other ranks' ids also map to local row 0); the last
        "padding_idx=per+2": lambda: scenario(False, per + 2),
        "padding_idx=per, sp": lambda: scenario(True, per),
        "padding_idx=-1": lambda: scenario(False, -1),
    })


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


@pytest.mark.parametrize(
    "case", ["plain", "sp", "padding_idx=per+2", "padding_idx=per, sp", "padding_idx=-1"])
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


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_padding_row_starts_at_zero_and_gets_no_gradient(tp, rank):
    dims = types.SimpleNamespace(tp=tp, tp_rank=rank, tp_group=None)
    torch.manual_seed(0)
    full = nn.Embedding(12, 4, padding_idx=7, dtype=DT)
    torch.manual_seed(0)
    pe = VocabParallelEmbedding(12, 4, dims, dtype=DT, padding_idx=-5)  # 12 - 5 = 7
    assert pe.padding_idx == 7 and "padding_idx=7" in repr(pe)
    per = 12 // tp
    torch.testing.assert_close(pe.weight, full.weight[rank * per:(rank + 1) * per], rtol=0, atol=0)
    if tp == 1:  # no collective: the whole forward and backward in this process
        ids = torch.tensor([[7, 1, 7, 11]])
        pe(ids).sum().backward()
        full(ids).sum().backward()
        torch.testing.assert_close(pe.weight.grad, full.weight.grad, rtol=0, atol=0)
        assert pe.weight.grad[7].eq(0).all()
    with pytest.raises(ValueError, match="padding_idx=12 is outside the vocabulary of size 12"):
        VocabParallelEmbedding(12, 4, dims, padding_idx=12)


@pytest.mark.parametrize("option,kw", [("max_norm", dict(max_norm=1.0)),
                                       ("scale_grad_by_freq", dict(scale_grad_by_freq=True)),
                                       ("sparse", dict(sparse=True))])
def test_from_dense_refuses_what_it_does_not_support(option, kw):
    with pytest.raises(ValueError, match=f"nn.Embedding's {option}=.* is not supported"):
        VocabParallelEmbedding.from_dense(nn.Embedding(12, 4, **kw), DIMS)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("bad", [12, -1, 100])
def test_token_ids_outside_the_vocabulary_name_its_size(tp, bad):
    emb = VocabParallelEmbedding(12, 4, types.SimpleNamespace(tp=tp, tp_rank=0, tp_group=None))
    ids = torch.tensor([[0, 11, bad, 3]])
    with pytest.raises(ValueError, match=rf"must be in \[0, 12\) for a vocabulary of size 12: "
                                         rf"got {bad}"):
        emb(ids)


def test_id_check_on_a_device_queues_an_assert_and_skips_fake_tensors(monkeypatch):
    """Off the CPU (here: while compiling) the check is torch._assert_async alone, no host
    read; a fake tensor has no values to check (its assert is a no-op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from distllm.nn.embedding import check_ids_in_vocab

    calls = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda t, msg: calls.append(msg) or real(t, msg))
    with FakeTensorMode():
        check_ids_in_vocab(torch.full((3,), 99), 6, "targets")  # out of range: no error
    calls.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    check_ids_in_vocab(torch.tensor([0, 5, -100]), 6, "targets", ignore_index=-100)
    with pytest.raises(RuntimeError, match=r"targets must be in \[0, 6\)"):
        check_ids_in_vocab(torch.tensor([0, 6]), 6, "targets")
    assert len(calls) == 2


@pytest.mark.gpu
def test_id_check_on_cuda_does_not_sync():
    from distllm.nn.embedding import check_ids_in_vocab

    ids = torch.randint(0, 50, (4, 64), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_ids_in_vocab(ids, 50, "token ids")
        check_ids_in_vocab(ids, 50, "targets", ignore_index=-100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
