"""bf16 on the CPU: the LayerNorm and embedding weight gradients are fp32 sums over the
tokens (torch's CPU kernels sum them in bf16), against float64; and the modules built on
them (``ParallelLayerNorm``, ``VocabParallelEmbedding``, the GPT's LayerNorm and whole
table) go through them."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from distllm import ParallelDims
from distllm.nn import ParallelLayerNorm
from distllm.nn.precision import Embedding, LayerNorm, embedding, layer_norm

N, H, V = 4096, 64, 256  # 4096 tokens: the tiny GPT's micro-batch on one rank by default
# bf16 rounds x, dy and the table to 8 bits (2^-9 relative): the gradients below land within
# 2.4e-3..3.2e-3 of float64 (max error over the largest entry); torch's own CPU kernels, which
# sum in bf16, at 1.1e-2 (embedding) and 6.5e-2 / 7.2e-2 (LayerNorm weight / bias)
TOL = 6e-3


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    dy = torch.randn(N, H, generator=g, dtype=torch.float64)
    ids = torch.randint(V, (N,), generator=g)
    table = torch.randn(V, H, generator=g, dtype=torch.float64)
    return x, w, b, dy, ids, table


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).detach().requires_grad_()


@pytest.mark.parametrize("module", [None, LayerNorm, ParallelLayerNorm])
def test_layer_norm_weight_grads_are_fp32_sums(module):
    x, w, b, dy, _, _ = _data()
    grads = {}
    for dt in (torch.float64, torch.bfloat16):
        xs, ws, bs = (_leaf(t, dt) for t in (x, w, b))
        if module is LayerNorm:
            ln = LayerNorm(H, dtype=dt)
            ln.weight, ln.bias = nn.Parameter(ws), nn.Parameter(bs)
            ws, bs = ln.weight, ln.bias
            y = ln(xs)
        elif module is ParallelLayerNorm:
            ln = ParallelLayerNorm(H, ParallelDims(tp=1, pp=1, dp=1), dtype=dt)
            ln.weight, ln.bias = nn.Parameter(ws), nn.Parameter(bs)
            ws, bs = ln.weight, ln.bias
            y = ln(xs)
        else:
            y = layer_norm(xs, (H,), ws, bs, 1e-5)
        assert y.dtype == dt
        y.backward(dy.to(dt))
        grads[dt] = (ws.grad, bs.grad)
    for got, want in zip(grads[torch.bfloat16], grads[torch.float64], strict=True):
        assert got.dtype == torch.bfloat16 and _rel(got, want) < TOL, _rel(got, want)


@pytest.mark.parametrize("module", [False, True], ids=["function", "Embedding"])
def test_embedding_grad_is_an_fp32_sum(module):
    _, _, _, dy, ids, table = _data()
    grads = {}
    for dt in (torch.float64, torch.bfloat16):
        t = _leaf(table, dt)
        if module:
            emb = Embedding(V, H, dtype=dt)
            emb.weight = nn.Parameter(t)
            t, y = emb.weight, emb(ids)
        else:
            y = embedding(ids, t)
        assert torch.equal(y.double(), table.to(dt).double()[ids])
        y.backward(dy.to(dt))
        grads[dt] = t.grad
    assert grads[torch.bfloat16].dtype == torch.bfloat16
    assert _rel(grads[torch.bfloat16], grads[torch.float64]) < TOL


def test_embedding_keeps_padding_idx_without_gradient():
    _, _, _, dy, ids, table = _data()
    t = _leaf(table, torch.bfloat16)
    embedding(ids, t, padding_idx=3).backward(dy.to(torch.bfloat16))
    assert (ids == 3).any() and not t.grad[3].any()
    assert t.grad[4].any()


def test_the_models_layers_go_through_them():
    """The GPT's LayerNorms and whole table, ParallelLayerNorm and VocabParallelEmbedding:
    the fp32 path (their bf16 CPU gradients within TOL of float64)."""
    from distllm.models.config import GPTConfig
    from distllm.models.gpt import GPT

    dims = ParallelDims(tp=1, pp=1, dp=1)
    cfg = GPTConfig.preset("tiny")
    kinds = set()
    for vp in ("off", "on"):
        model = GPT(cfg, dims, dtype=torch.bfloat16, vocab_parallel=vp)
        kinds |= {type(m).__name__ for m in model.modules()}
    assert {"LayerNorm", "Embedding", "VocabParallelEmbedding"} <= kinds
    assert all(type(m).__module__ != "torch.nn.modules.normalization"
               for m in GPT(cfg, dims, dtype=torch.bfloat16).modules())


def test_fx_records_them_as_calls():
    m = nn.Sequential(LayerNorm(8), nn.Linear(8, 8))
    targets = {n.target for n in fx.symbolic_trace(m).graph.nodes if n.op == "call_function"}
    assert layer_norm in targets
    e = nn.Sequential(Embedding(10, 4))
    assert embedding in {n.target for n in fx.symbolic_trace(e).graph.nodes}
