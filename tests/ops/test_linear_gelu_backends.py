"""The linear_gelu backends (distllm.ops.linear_gelu_backends) when one fails, on CPU with the
cuBLASLt calls replaced: cuBLASLt offering no algorithm (NotImplementedError from the
kernel) runs the next backend and says so once per phase, other errors propagate;
``backend="auto"`` drops a candidate that raises during its timing run and picks among the
others. Results against float64."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from distllm.ops import backend_choice, extensions, linear_gelu
from distllm.ops import linear_gelu_backends as impl

TOL32 = 2e-5  # fp32 GEMMs over K <= 64 and erf/tanh ulps, relative to the largest magnitude


def _no_algorithm(*args):
    raise NotImplementedError("cuBLASLt found no algorithm for epilogue 0 (test)")


def _data(M=7, K=48, N=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * K**-0.5
    b = torch.randn(N, generator=g, dtype=torch.float64) * 0.5
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _rel(got, want) -> float:
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-3)


@pytest.fixture
def no_cublaslt(monkeypatch):
    monkeypatch.setattr(impl, "_cublaslt_fwd", _no_algorithm)
    monkeypatch.setattr(impl, "_cublaslt_wgrad", _no_algorithm)
    monkeypatch.setattr(impl, "_fallback_warned", set())


def test_next_backend_is_triton_where_it_serves_else_reference(monkeypatch):
    x, w, _ = _data()
    exc = NotImplementedError("no algorithm")
    monkeypatch.setattr(impl, "_fallback_warned", {"forward"})  # already said
    real = impl.why_not
    monkeypatch.setattr(impl, "why_not", lambda be, *a: None if be == "triton" else real(be, *a))
    assert impl._after_cuda(x, w, "tanh", "forward", exc) == "triton"
    monkeypatch.setattr(impl, "why_not", lambda be, *a: "no" if be == "triton" else real(be, *a))
    assert impl._after_cuda(x, w, "tanh", "forward", exc) == "reference"


def test_forward_falls_back_once_warned(no_cublaslt, caplog, monkeypatch):
    # the next backend here is the reference (triton refused), so the result is exact math
    # (and 'cuda' serves these CPU tensors as far as the op's own check goes: the stand-in
    # cuBLASLt above finds no algorithm)
    real = impl.why_not
    monkeypatch.setattr(impl, "why_not", lambda be, *a: {"triton": "no", "cuda": None}.get(
        be, real(be, *a)))
    x, w, b = _data()
    want = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    with caplog.at_level(logging.WARNING, logger="distllm"):
        for _ in range(3):
            y, pre = torch.ops.distllm.linear_gelu_fwd(x, w, b, "tanh", "cuda", True)
            assert _rel(y, want) <= TOL32
            assert _rel(pre, F.linear(x.double(), w.double(), b.double())) <= TOL32
    msgs = [r.getMessage() for r in caplog.records if "no algorithm" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "backend 'cuda' (forward)" in msgs[0] and "using backend 'reference'" in msgs[0]


def test_backward_falls_back_to_torch_gemms(no_cublaslt, caplog):
    # bias_gelu_backward's CPU kernel
    assert extensions.load("_C") is not None, extensions.status("_C")
    x, w, b = _data()
    pre = F.linear(x, w, b)
    g = torch.randn(pre.shape, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="distllm"):
        dx, dw, db = impl.bwd("cuda", g, x, w, pre, True, "tanh", True, True)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    F.gelu(F.linear(xr, wr, br), approximate="tanh").backward(g.double())
    for got, want in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        assert _rel(got, want) <= TOL32
    assert any("(backward)" in r.getMessage() for r in caplog.records)


def test_other_cublaslt_errors_propagate(monkeypatch):
    def fails(*args):
        raise RuntimeError("cuBLASLt call failed: cublasLtMatmul(...) status=13")

    monkeypatch.setattr(impl, "_cublaslt_fwd", fails)
    x, w, b = _data()
    with pytest.raises(RuntimeError, match="status=13"):
        impl.fwd("cuda", x, w, b, "tanh", False)


def test_auto_drops_a_backend_that_raises(monkeypatch):
    # make 'cuda' a candidate for CPU tensors whose cuBLASLt call fails outright
    real = impl.why_not
    monkeypatch.setattr(impl, "why_not", lambda be, *a: None if be == "cuda" else real(be, *a))

    def fails(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    monkeypatch.setattr(impl, "_cublaslt_fwd", fails)
    backend_choice.clear()
    x, w, b = _data(M=13, K=24, N=16, dtype=torch.float64)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = linear_gelu(xr, wr, br, approximate="tanh")  # auto: measures cuda, cpu, reference
    y.sum().backward()
    chosen = [v for k, v in backend_choice.cached().items() if "(rows<=16, 24)x(16, 24)" in k]
    assert chosen in (["cpu"], ["reference"]), chosen
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    F.gelu(F.linear(xs, ws, bs), approximate="tanh").sum().backward()
    torch.testing.assert_close(y, F.gelu(F.linear(x, w, b), approximate="tanh"), rtol=0, atol=1e-12)
    for got, want in ((xr.grad, xs.grad), (wr.grad, ws.grad), (br.grad, bs.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_cuda_refuses_what_cublaslt_cannot_lay_out(monkeypatch):
    """The cuda backend's own checks, past the extension and device checks: the tanh form
    only, features multiples of 8, and no empty GEMM (a leading dimension of 0, which
    cuBLASLt's layouts refuse with an error no backend would catch)."""
    monkeypatch.setattr(impl, "_cuda_ext_status", lambda: (True, "ok"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, w = torch.empty(4, 16), torch.empty(8, 16)
    assert impl.why_not("cuda", x, w, "tanh") is None
    assert "tanh form" in impl.why_not("cuda", x, w, "none")
    assert "multiples of 8" in impl.why_not("cuda", torch.empty(4, 12), torch.empty(8, 12), "tanh")
    assert "in_features > 0" in impl.why_not("cuda", torch.empty(4, 0), torch.empty(8, 0), "tanh")
