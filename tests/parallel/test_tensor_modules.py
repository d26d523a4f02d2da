"""Parallel modules (embedding, cross-entropy, MLP, attention, LayerNorm, a full transformer
block with and without sequence parallelism) on 2 and 4 gloo ranks, in float64, against the
dense single-process modules built from the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distllm import ParallelDims
from distllm.nn.attention import DenseAttention, ParallelAttention
from distllm.nn.cross_entropy import vocab_parallel_cross_entropy
from distllm.nn.embedding import VocabParallelEmbedding
from distllm.nn.layernorm import ParallelLayerNorm
from distllm.nn.mlp import DenseMLP, ParallelMLP
from distllm.nn.parallel_linear import ColumnParallelLinear, gather_sequence, scatter_sequence
from distllm.testing import run_distributed

TOL = 1e-10  # float64; reductions reordered over <= 64 terms
DT = torch.float64


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


class DenseBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, h, n_heads, n_kv, ffn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h, dtype=DT), nn.LayerNorm(h, dtype=DT)
        self.attn = DenseAttention(h, n_heads, n_kv, dtype=DT)
        self.mlp = DenseMLP(h, ffn, activation="gelu_tanh", dtype=DT)
        with torch.no_grad():  # non-trivial LayerNorm parameters
            for ln in (self.ln1, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelBlock(nn.Module):
    def __init__(self, dense: DenseBlock, dims, sp: bool, overlap: str, chunks: int):
        super().__init__()
        self.ln1 = ParallelLayerNorm.from_dense(dense.ln1, dims, sequence_parallel=sp)
        self.ln2 = ParallelLayerNorm.from_dense(dense.ln2, dims, sequence_parallel=sp)
        kw = dict(sequence_parallel=sp, overlap=overlap, chunks=chunks)
        self.attn = ParallelAttention.from_dense(dense.attn, dims, **kw)
        self.mlp = ParallelMLP.from_dense(dense.mlp, dims, **kw)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _expected_grads(d: DenseBlock, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Each parallel parameter's expected grad: this rank's shard of the dense grad."""
    a, m = d.attn, d.mlp
    qkv = lambda n: torch.cat([getattr(getattr(a, p), n).grad.chunk(tp, 0)[r]  # noqa: E731
                               for p in "qkv"])
    return {
        "ln1.weight": d.ln1.weight.grad, "ln1.bias": d.ln1.bias.grad,
        "ln2.weight": d.ln2.weight.grad, "ln2.bias": d.ln2.bias.grad,
        "attn.qkv.weight": qkv("weight"), "attn.qkv.bias": qkv("bias"),
        "attn.o.weight": a.o.weight.grad.chunk(tp, 1)[r], "attn.o.bias": a.o.bias.grad,
        "mlp.fc1.weight": m.fc1.weight.grad.chunk(tp, 0)[r],
        "mlp.fc1.bias": m.fc1.bias.grad.chunk(tp, 0)[r],
        "mlp.fc2.weight": m.fc2.weight.grad.chunk(tp, 1)[r], "mlp.fc2.bias": m.fc2.bias.grad,
    }


def _block(tp: int):
    dims = ParallelDims(tp=tp)
    torch.manual_seed(0)
    h, n_heads, n_kv, ffn = 32, 8, 4, 48  # grouped-query: 2 query heads per kv head
    dense = DenseBlock(h, n_heads, n_kv, ffn)
    x = torch.randn(2, 3 * tp, h, dtype=DT)
    xd = x.clone().requires_grad_()
    ref = dense(xd)
    proj = torch.randn_like(ref)
    (ref * proj).sum().backward()
    want = _expected_grads(dense, tp, dims.tp_rank)
    errs, replicated = {}, {}
    for sp in (False, True):
        for overlap, chunks in (("none", 4), ("chunked", 2), ("chunked", 4), ("auto", 4)):
            tag = f"sp={sp} {overlap}{chunks}"
            blk = ParallelBlock(dense, dims, sp, overlap, chunks)
            xp = x.clone().requires_grad_()
            y = blk(scatter_sequence(xp, dims) if sp else xp)
            y = gather_sequence(y, dims) if sp else y
            (y * proj).sum().backward()
            errs[f"{tag} out"], errs[f"{tag} dx"] = _err(y, ref), _err(xp.grad, xd.grad)
            got = dict(blk.named_parameters())
            assert set(got) == set(want), sorted(got)
            for name, g in want.items():
                errs[f"{tag} {name}"] = _err(got[name].grad, g)
            replicated[tag] = [got[n].grad.tolist() for n in ("ln1.weight", "attn.o.bias")]
            assert blk.attn.overlap_stats["o"].forward.calls == 1
    return errs, replicated


def _modules(tp: int):
    dims = ParallelDims(tp=tp)
    r = dims.tp_rank
    torch.manual_seed(0)
    errs = {}
    # vocab-parallel embedding, plain and sequence-parallel
    vocab, h = 5 * tp, 6
    emb = nn.Embedding(vocab, h, dtype=DT)
    ids = torch.randint(0, vocab, (3, 2 * tp))
    for sp in (False, True):
        emb.zero_grad()
        ref = emb(ids)
        (ref * ref).sum().backward()
        pe = VocabParallelEmbedding.from_dense(emb, dims, sequence_parallel=sp)
        y = pe(ids)
        y = gather_sequence(y, dims) if sp else y
        (y * y).sum().backward()
        errs[f"emb sp={sp} out"] = _err(y, ref)
        errs[f"emb sp={sp} grad"] = _err(pe.weight.grad, emb.weight.grad.chunk(tp, 0)[r])
    # cross-entropy over vocabulary shards: shifted logits, ignore_index, every reduction
    v = 7 * tp
    logits = torch.randn(3, 5, v, dtype=DT) * 3 + 1e4
    tgt = torch.randint(0, v, (3, 5))
    tgt[0, 1] = tgt[2, 4] = -100
    tgt[1, 0] = 3
    for red in ("mean", "sum", "none"):
        ld = logits.clone().requires_grad_()
        ref = F.cross_entropy(ld.view(-1, v), tgt.view(-1), reduction=red)
        ref = ref.view(3, 5) if red == "none" else ref
        lp = logits.chunk(tp, -1)[r].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(lp, tgt, dims, reduction=red)
        w = torch.rand_like(ref)
        (ref * w).sum().backward()
        (got * w).sum().backward()
        errs[f"ce {red}"] = _err(got, ref)
        errs[f"ce {red} grad"] = _err(lp.grad, ld.grad.chunk(tp, -1)[r])
    lp = logits[..., :2].clone()  # ignore_index=-1 changes which tokens count
    tgt2 = tgt.clamp(0, 2 * tp - 1)
    gathered = [torch.empty_like(lp) for _ in range(tp)]
    torch.distributed.all_gather(gathered, lp, group=dims.tp_group)
    ref = F.cross_entropy(torch.cat(gathered, -1).view(-1, 2 * tp), tgt2.view(-1), ignore_index=1)
    errs["ce ignore_index=1"] = _err(vocab_parallel_cross_entropy(lp, tgt2, dims, ignore_index=1),
                                     ref)
    # embedding -> sequence-parallel MLP -> column-parallel head -> cross-entropy
    mlp = DenseMLP(h, 4 * tp, dtype=DT)
    head = nn.Linear(h, vocab, bias=False, dtype=DT)
    tgt3 = torch.randint(0, vocab, ids.shape)
    for mod in (emb, mlp, head):
        mod.zero_grad()
    e = emb(ids)
    F.cross_entropy(head(e + mlp(e)).view(-1, vocab), tgt3.view(-1)).backward()
    pe = VocabParallelEmbedding.from_dense(emb, dims, sequence_parallel=True)
    pm = ParallelMLP.from_dense(mlp, dims, sequence_parallel=True, overlap="chunked", chunks=3)
    ph = ColumnParallelLinear.from_dense(head, dims, sequence_parallel=True, overlap="chunked")
    e = pe(ids)
    vocab_parallel_cross_entropy(ph(e + pm(e)), tgt3, dims).backward()
    errs["e2e emb grad"] = _err(pe.weight.grad, emb.weight.grad.chunk(tp, 0)[r])
    errs["e2e fc2 grad"] = _err(pm.fc2.weight.grad, mlp.fc2.weight.grad.chunk(tp, 1)[r])
    errs["e2e head grad"] = _err(ph.weight.grad, head.weight.grad.chunk(tp, 0)[r])
    return errs


def _bad_inputs():
    dims = ParallelDims(tp=2)
    cases = {
        "heads": lambda: ParallelAttention(24, 3, dims),
        "hidden": lambda: ParallelAttention(30, 4, dims),
        "kv_divides": lambda: ParallelAttention(32, 4, dims, n_kv_heads=3),
        "kv_tp": lambda: ParallelAttention(32, 4, dims, n_kv_heads=1),
        "ffn": lambda: ParallelMLP(8, 7, dims),
        "vocab": lambda: VocabParallelEmbedding(11, 4, dims),
        "emb_seq": lambda: VocabParallelEmbedding(12, 4, dims, sequence_parallel=True)(
            torch.zeros(1, 5, dtype=torch.long)),
        "seq": lambda: scatter_sequence(torch.zeros(2, 5, 8), dims),
        "reduction": lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2),
                                                          dims, reduction="avg"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_parity_with_and_without_sp(tp):
    for rank, (errs, _) in enumerate(res := run_distributed(_block, tp, tp, timeout=240)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"
    for rank in range(1, tp):  # replicated params (LayerNorm, row bias) agree across tp ranks
        assert res[rank][1] == res[0][1]


@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_cross_entropy_and_end_to_end(tp):
    for rank, errs in enumerate(run_distributed(_modules, tp, tp, timeout=180)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_bad_input_names_the_knob():
    msgs = run_distributed(_bad_inputs, 2, timeout=60)[0]
    knobs = {"heads": "n_heads", "hidden": "n_heads", "kv_divides": "n_kv_heads",
             "kv_tp": "n_kv_heads", "ffn": "ffn_hidden", "vocab": "pad the vocabulary",
             "emb_seq": "multiple of tp", "seq": "seq_len", "reduction": "reduction"}
    for name, knob in knobs.items():
        assert msgs[name] is not None, f"{name}: no error raised"
        assert knob in msgs[name], (name, msgs[name])
