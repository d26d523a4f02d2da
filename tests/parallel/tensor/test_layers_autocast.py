"""Column- and row-parallel layers under ``torch.autocast`` at tp=2, through every overlap
engine: they compute in the autocast dtype like ``nn.Linear`` (the engines' GEMMs write into
preallocated outputs, which autocast itself cannot cast), gradients reach the float32
parameters, and the result matches the dense pair run under the same autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distllm import ParallelDims
from distllm.nn.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_sequence,
    scatter_sequence,
)
from distllm.testing import run_distributed

# bf16 keeps 8 significant bits (eps 2^-8); the parallel pair rounds its partial sums and
# the all-reduced result once more than the dense pair: a few eps of outputs of size ~1.
ATOL = 3e-2
CASES = [("none", 1, False), ("chunked", 3, False), ("chunked", 2, True), ("auto", 4, False)]


def _rank(mode: str, chunks: int, sp: bool) -> dict:
    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    d1, d2 = nn.Linear(16, 48), nn.Linear(48, 16)  # float32 parameters
    x = torch.randn(2, 8, 16)
    c = ColumnParallelLinear.from_dense(d1, dims, activation="gelu", overlap=mode,
                                        chunks=chunks, sequence_parallel=sp)
    r = RowParallelLinear.from_dense(d2, dims, overlap=mode, chunks=chunks, sequence_parallel=sp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = d2(F.gelu(d1(x)))
        y = r(c(scatter_sequence(x, dims) if sp else x))
        y = gather_sequence(y, dims) if sp else y
    y.float().sum().backward()
    grads = [p.grad for p in (*c.parameters(), *r.parameters())]
    return {
        "dtype": str(y.dtype),
        "ref_dtype": str(ref.dtype),
        "err": (y.float() - ref.float()).abs().max().item(),
        "grad_dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
        "grads": sum(g is not None for g in grads),
    }


@pytest.mark.parametrize(("mode", "chunks", "sp"), CASES,
                         ids=[f"{m}{c}{'-sp' if s else ''}" for m, c, s in CASES])
def test_parallel_pair_follows_autocast(mode, chunks, sp):
    for res in run_distributed(_rank, 2, mode, chunks, sp, timeout=120):
        assert res["ref_dtype"] == "torch.bfloat16"
        assert res["dtype"] == "torch.bfloat16", "the parallel pair did not compute in bf16"
        assert res["err"] < ATOL, f"parallel vs dense under autocast: {res['err']:.3g}"
        assert res["grads"] == 4, "a parameter got no gradient"
        assert res["grad_dtypes"] == ["torch.float32"], "gradients must reach float32 params"
