"""zb-h1's split backward through the tensor-parallel layers and the fused GEMM + GeLU / MLP
(``distllm.ops.weight_grad``): under ``DeferLinearWeightGrads`` their backward (B) gives
the input gradient and leaves every weight-gradient GEMM to W; B then W equals one plain
backward in float64, on 2 gloo ranks with and without sequence parallelism, in each overlap
mode, and on one process (the fused MLP at tp 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.ops.weight_grad import DeferLinearWeightGrads, WeightGradStore
from distllm.parallel.tensor.fused_mlp import _SingleDevice  # the mesh of one device
from distllm.testing import run_distributed
from tests._errors import worst

TOL = 1e-12


class _Block(nn.Module):
    """column -> row -> fused MLP -> fused column + GeLU, as the model's blocks chain them."""

    def __init__(self, dims, sp: bool, overlap: str, backend: str):
        from distllm.nn import ColumnParallelLinear, ParallelMLP, RowParallelLinear

        super().__init__()
        tp, h = dims.tp, 6
        kw = dict(dims=dims, sequence_parallel=sp, overlap=overlap, dtype=torch.float64)
        self.col = ColumnParallelLinear(h, 4 * tp, **kw)
        self.row = RowParallelLinear(4 * tp, h, **kw)
        self.mlp = ParallelMLP(h, 4 * tp, backend=backend, **kw)
        self.head = ColumnParallelLinear(h, 2 * tp, activation="gelu_tanh", backend=backend,
                                         **kw)

    def forward(self, x):
        return self.head(self.mlp(self.row(torch.tanh(self.col(x)))))


def _split_equals_plain(dims, sp: bool, overlap: str, backend: str) -> dict:
    torch.manual_seed(0)
    block = _Block(dims, sp, overlap, backend)
    s = 4 // dims.tp if sp else 4
    x = torch.randn(2, s, 6, dtype=torch.float64)
    torch.manual_seed(1 + dims.tp_rank)
    gy = torch.randn(2, 4, 2, dtype=torch.float64)
    params = list(block.parameters())
    xr = x.clone().requires_grad_()
    torch.autograd.backward(block(xr), gy)
    ref = [p.grad.clone() for p in params]
    block.zero_grad(set_to_none=True)

    store, xi = WeightGradStore(), x.clone().requires_grad_()
    with DeferLinearWeightGrads(store):
        y = block(xi)
    grads = torch.autograd.grad(y, [xi] + params, gy, allow_unused=True)  # B
    in_b = [n for (n, _), g in zip(block.named_parameters(), grads[1:], strict=True)
            if g is not None]
    store.params += [p for p, g in zip(params, grads[1:], strict=True) if g is not None]
    store.grads += [g for g in grads[1:] if g is not None]
    assert all(p.grad is None for p in params)
    store.accumulate()  # W
    return {"dx": float((grads[0] - xr.grad).abs().max()), "in_b": in_b,
            "dw": worst(float((p.grad - r).abs().max()) for p, r in zip(params, ref, strict=True)),
            "deferred_left": len(store.deferred)}


def _tp2(cases):
    from distllm import ParallelDims

    dims = ParallelDims(tp=2)
    return [_split_equals_plain(dims, *c) for c in cases]


CASES = [(sp, ov, be) for sp in (False, True) for ov in ("none", "chunked")
         for be in ("cpu", "reference")]


@pytest.fixture(scope="module")
def tp2_results():
    out = run_distributed(_tp2, 2, CASES, timeout=180)
    return {c: [rank[i] for rank in out] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'sp' if c[0] else 'nosp'}-{c[1]}-{c[2]}")
def test_tensor_parallel_weight_grads_wait_for_w(tp2_results, case):
    sp = case[0]
    for r in tp2_results[case]:
        assert r["dx"] < TOL and r["dw"] < TOL, r
        assert r["deferred_left"] == 0
        # B: only the biases whose gradient it must reduce (row-parallel, replicated: an
        # all-reduce under sp) or that its fused kernel summed; every weight waits for W
        assert not [n for n in r["in_b"] if n.endswith("weight")], r["in_b"]
        assert {"row.bias", "mlp.fc2.bias"} <= set(r["in_b"]) or not sp, r["in_b"]
        assert "col.bias" not in r["in_b"], r["in_b"]


def test_fused_mlp_at_tp1_weight_grads_wait_for_w():
    r = _split_equals_plain(_SingleDevice(), False, "none", "cpu")
    assert r["dx"] < TOL and r["dw"] < TOL, r
    assert not [n for n in r["in_b"] if n.endswith("weight")], r["in_b"]


def test_backend_auto_timing_runs_leave_nothing_to_w():
    """``backend="auto"`` times each candidate, forward and backward, on copies of the
    weights the first time it meets a shape: inside zb-h1's forward those runs left their
    weight GEMMs (and the tensors they hold) to W, 12 records beside the layer's one."""
    from distllm.nn import ColumnParallelLinear

    torch.manual_seed(0)
    col = ColumnParallelLinear(13, 7, _SingleDevice(), activation="gelu", backend="auto",
                               dtype=torch.float64)  # a shape no other test times
    x = torch.randn(3, 5, 13, dtype=torch.float64)
    for _ in range(2):  # the first call times the candidates; the second reuses the choice
        store = WeightGradStore()
        with DeferLinearWeightGrads(store):
            y = col(x)
        torch.autograd.grad(y, list(col.parameters()), torch.ones_like(y), allow_unused=True)
        recorded = [[id(p) for p in ps if p is not None] for ps, _ in store.deferred]
        assert len(recorded) == 1 and id(col.weight) in recorded[0], recorded
        assert set(recorded[0]) <= {id(p) for p in col.parameters()}
        store.accumulate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_linear_under_autocast_defers_as_autocast_runs_it(dtype):
    """``nn.Linear`` under bfloat16 autocast: B's input gradient and W's weight gradient are
    autocast's. float32 parameters: the GEMMs in bfloat16, the gradients cast back to the
    parameters' dtype (the bfloat16 output gradient met the float32 weight before); float64
    ones: autocast leaves them, and so does the deferral."""
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 6, dtype=dtype), torch.randn(4, 8, dtype=dtype)
    gy = torch.randn(4, 6, dtype=dtype)
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xr)
    y.backward(gy.to(y.dtype))
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    store, xi = WeightGradStore(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), DeferLinearWeightGrads(store):
        y2 = lin(xi)
    want = torch.bfloat16 if dtype == torch.float32 else torch.float64
    assert y.dtype == want and y2.dtype == want and torch.equal(y2, y)
    (dx,) = torch.autograd.grad(y2, [xi], gy.to(y2.dtype))
    store.accumulate()
    assert dx.dtype == dtype and torch.equal(dx, xr.grad)
    for p, r in zip(lin.parameters(), ref, strict=True):
        assert p.grad.dtype == dtype and torch.equal(p.grad, r), (p.grad, r)


def test_another_thread_does_not_defer_into_this_threads_store():
    """The deferral is per thread, as torch's function modes are: a backward in another
    thread while this one is inside ``DeferLinearWeightGrads`` computes its own weight
    gradient."""
    import threading

    from distllm.ops import linear_gelu

    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    store = WeightGradStore()
    with DeferLinearWeightGrads(store):
        t = threading.Thread(
            target=lambda: linear_gelu(x, w, None, backend="cpu").sum().backward())
        t.start()
        t.join()
    assert not store.deferred and w.grad is not None
