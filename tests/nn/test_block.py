"""``ParallelAttention``, ``ParallelMLP`` and ``ParallelLayerNorm`` assembled into a pre-LN
transformer block, on 2 and 4 gloo ranks in float64, against the dense block built from the
same weights (output, input grad, every parameter's grad), with and without sequence
parallelism, for each overlap mode; the errors that name the knob. One spawn per world
size, each scenario its own test."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.nn.attention import DenseAttention, ParallelAttention
from distllm.nn.layernorm import ParallelLayerNorm
from distllm.nn.mlp import DenseMLP, ParallelMLP
from distllm.nn.parallel_linear import gather_sequence, scatter_sequence
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64; reductions reordered over <= 64 terms
DT = torch.float64
SCENARIOS = {f"sp={sp} {overlap}{chunks}": (sp, overlap, chunks)
             for sp in (False, True)
             for overlap, chunks in (("none", 4), ("chunked", 2), ("chunked", 4), ("auto", 4))}


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


def block_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    tp = dims.tp
    torch.manual_seed(0)
    h, n_heads, n_kv, ffn = 32, 8, 4, 48  # grouped-query: 2 query heads per kv head
    dense = DenseBlock(h, n_heads, n_kv, ffn)
    x = torch.randn(2, 3 * tp, h, dtype=DT)
    xd = x.clone().requires_grad_()
    ref = dense(xd)
    proj = torch.randn_like(ref)
    (ref * proj).sum().backward()
    want = _expected_grads(dense, tp, dims.tp_rank)

    def scenario(sp: bool, overlap: str, chunks: int) -> dict:
        blk = ParallelBlock(dense, dims, sp, overlap, chunks)
        xp = x.clone().requires_grad_()
        y = blk(scatter_sequence(xp, dims) if sp else xp)
        y = gather_sequence(y, dims) if sp else y
        (y * proj).sum().backward()
        got = dict(blk.named_parameters())
        errs = {"out": _err(y, ref), "dx": _err(xp.grad, xd.grad)}
        errs.update({name: _err(got[name].grad, g) for name, g in want.items()})
        return {"errs": errs, "names": sorted(got),
                "replicated": [got[n].grad.tolist() for n in ("ln1.weight", "attn.o.bias")],
                "o_forward_calls": blk.attn.overlap_stats["o"].forward.calls}

    cases = {name: (lambda s=s, o=o, c=c: scenario(s, o, c))
             for name, (s, o, c) in SCENARIOS.items()}
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=240)


@pytest.mark.parametrize("case", list(SCENARIOS))
@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_parity(spawned, tp, case):
    results = case_of(spawned(block_main, tp), case)
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert res["names"] == sorted(_NAMES), res["names"]
        assert res["o_forward_calls"] == 1
    # replicated parameters (LayerNorm, row bias) have the same grad on every tp rank
    assert all(res["replicated"] == results[0]["replicated"] for res in results)


_NAMES = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.qkv.weight",
          "attn.qkv.bias", "attn.o.weight", "attn.o.bias", "mlp.fc1.weight", "mlp.fc1.bias",
          "mlp.fc2.weight", "mlp.fc2.bias"]
DIMS = types.SimpleNamespace(tp=2, tp_rank=0, tp_group=None)  # no collective runs below
BAD = {  # name: (what raises, the knob its message must name)
    "heads": (lambda: ParallelAttention(24, 3, DIMS), "n_heads"),
    "hidden": (lambda: ParallelAttention(30, 4, DIMS), "n_heads"),
    "kv_divides": (lambda: ParallelAttention(32, 4, DIMS, n_kv_heads=3), "n_kv_heads"),
    "kv_tp": (lambda: ParallelAttention(32, 4, DIMS, n_kv_heads=1), "n_kv_heads"),
    # 0 was read as "as many as n_heads", silently
    "kv_zero": (lambda: ParallelAttention(32, 4, DIMS, n_kv_heads=0),
                "n_kv_heads=0: give a positive number of heads"),
    "ffn": (lambda: ParallelMLP(8, 7, DIMS), "ffn_hidden"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_knob(case):
    make, knob = BAD[case]
    with pytest.raises(ValueError, match=knob):
        make()


@pytest.mark.parametrize("make", [lambda: DenseAttention(8, 2),
                                  lambda: ParallelAttention(8, 2, types.SimpleNamespace(
                                      tp=1, tp_rank=0, tp_group=None))],
                         ids=["dense", "parallel"])
@pytest.mark.parametrize("shape", [(5, 8), (1, 2, 5, 8)])
def test_attention_names_the_shape_it_takes(make, shape):
    m = make()
    with pytest.raises(ValueError) as e:
        m(torch.randn(*shape))
    assert str(e.value) == (f"{type(m).__name__} takes (batch, seq, hidden) input, got shape "
                            f"{shape}: for one sequence pass x.unsqueeze(0)")


@pytest.mark.parametrize("kind", ["ColumnParallelLinear", "RowParallelLinear"])
def test_from_dense_takes_another_dtype(kind):
    """``dtype`` among the constructor's kwargs overrides the dense layer's (it was given twice)."""
    from distllm.nn import parallel_linear

    dims = types.SimpleNamespace(tp=1, tp_rank=0, tp_group=None)
    dense = nn.Linear(4, 6, dtype=torch.float64)
    m = getattr(parallel_linear, kind).from_dense(dense, dims, dtype=torch.float32)
    assert m.weight.dtype == m.bias.dtype == torch.float32
    assert torch.equal(m.weight, dense.weight.float()) and torch.equal(m.bias, dense.bias.float())
    assert getattr(parallel_linear, kind).from_dense(dense, dims).weight.dtype == torch.float64
