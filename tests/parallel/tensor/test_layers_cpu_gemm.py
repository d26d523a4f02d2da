"""The tensor-parallel GEMMs that distllm runs itself (the overlap engines' chunks, the
column-parallel forward, the row-parallel input gradient) go through the measured CPU GEMM
(distllm.ops.cpu_gemm) in float32: with oneDNN's linear pinned, and with torch's, the
column- and row-parallel pair at tp=2 matches the float64 dense pair (output, input
gradient, every weight and bias gradient) to float32 rounding, through the plain and the
sequence-parallel engines, with and without the fused GeLU, and through the fused MLP (whose
backward GEMM carries the GeLU derivative)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distllm import ParallelDims
from distllm.nn import ParallelMLP
from distllm.nn.mlp import DenseMLP
from distllm.nn.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_sequence,
    scatter_sequence,
)
from distllm.ops import backend_choice
from distllm.testing import run_distributed
from tests._onednn import ONEDNN, PINNED

# float32 GEMMs over K <= 96 (~sqrt(K) * 6e-8 relative) and one fp32 all-reduce: a few 1e-6
# of the largest magnitude; a wrong or missing product is O(1) off
RTOL = 2e-5
CASES = [(None, False), ("gelu", False), (None, True), ("gelu", True), ("mlp", False),
         ("mlp", True)]


def _rank(pinned: str, act: str | None, sp: bool) -> dict:
    asked: list[str] = []
    real = backend_choice.lookup

    def lookup(key, device, usable=None):  # every measured CPU GEMM runs the pinned library
        if not key.startswith("cpu_gemm|"):
            return real(key, device, usable)  # e.g. the fused GEMM + GeLU's backend choice
        asked.append("|".join(key.split("|")[i] for i in (1, 3)))  # cpu_gemm|kind|dtype|shapes
        return pinned

    backend_choice.lookup = lookup  # this rank's process only
    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    d1, d2 = nn.Linear(64, 96), nn.Linear(96, 64)  # float32
    x = torch.randn(3, 8, 64)
    if act == "mlp":  # ParallelMLP's fused path, its cpu backend pinned
        dense = DenseMLP(64, 96)
        dense.fc1, dense.fc2 = d1, d2
        mlp = ParallelMLP.from_dense(dense, dims, sequence_parallel=sp, overlap="chunked",
                                     chunks=3, backend="cpu")
        c, r, f = mlp.fc1, mlp.fc2, mlp
    else:
        c = ColumnParallelLinear.from_dense(d1, dims, activation=act, overlap="chunked",
                                            chunks=3, sequence_parallel=sp)
        r = RowParallelLinear.from_dense(d2, dims, overlap="chunked", chunks=3,
                                         sequence_parallel=sp)

        def f(t):
            return r(c(t))
    xp = x.clone().requires_grad_()
    y = f(scatter_sequence(xp, dims) if sp else xp)
    y = gather_sequence(y, dims) if sp else y
    wgt = torch.linspace(-1, 1, 64)
    (y * wgt).sum().backward()
    e1, e2 = (nn.Linear(m.in_features, m.out_features, dtype=torch.float64) for m in (d1, d2))
    with torch.no_grad():
        for e, d in ((e1, d1), (e2, d2)):
            e.weight.copy_(d.weight)
            e.bias.copy_(d.bias)
    xd = x.double().requires_grad_()
    h = e1(xd)
    ref = e2(h if act is None else F.gelu(h))  # exact GeLU: DenseMLP's default too
    (ref * wgt.double()).sum().backward()
    rk = dims.tp_rank

    def rel(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    errs = {"out": rel(y, ref), "dx": rel(xp.grad, xd.grad),
            "col.w": rel(c.weight.grad, e1.weight.grad.chunk(2, 0)[rk]),
            "col.b": rel(c.bias.grad, e1.bias.grad.chunk(2, 0)[rk]),
            "row.w": rel(r.weight.grad, e2.weight.grad.chunk(2, 1)[rk]),
            "row.b": rel(r.bias.grad, e2.bias.grad)}
    return {"errs": errs, "asked": sorted({a.split("|")[0] for a in asked}),
            "asked_shapes": sorted(set(asked))}


@pytest.mark.parametrize("pinned", PINNED)
@pytest.mark.parametrize(("act", "sp"), CASES, ids=[f"{a or 'linear'}{'-sp' if s else ''}"
                                                    for a, s in CASES])
def test_parallel_pair_through_the_measured_gemm(pinned, act, sp):
    for rank, res in enumerate(run_distributed(_rank, 2, pinned, act, sp, timeout=120)):
        bad = {k: v for k, v in res["errs"].items() if not v < RTOL}
        assert not bad, f"rank {rank}, {pinned}: {bad}"
        if not ONEDNN:  # one library: nothing is measured, so nothing asks the choice
            assert res["asked"] == [], res["asked"]
            continue
        # the forward GEMMs (a @ w.T) and the input-gradient GEMMs (a @ w) both asked
        assert {"mm", "mm_t"} <= set(res["asked"]), res["asked"]
        if act == "mlp":  # the fused backward's GEMM dZ @ W2 (64, 48), in chunks under sp
            assert any(a.startswith("mm|") and a.endswith("x(64, 48)")
                       for a in res["asked_shapes"]), res["asked_shapes"]
