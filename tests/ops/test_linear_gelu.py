"""linear_gelu against an independent float64 oracle (the GEMM, GeLU and its derivative
written out from their formulas, gradients by hand: neither ``F.gelu`` nor autograd), on every
backend this machine runs (CPU, the unfused reference, Triton through its interpreter when
there is no GPU), plus the registration (opcheck, torch.compile), the measured ``auto`` choice
and input checks. GPU backends: the tests marked ``gpu`` (run by bench/gpu_check.sh)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from distllm.ops import (
    backend_choice,
    backends,
    extensions,
    gemm_dgelu,
    linear_gelu,
    linear_gelu_reference,
)
from tests._onednn import PINNED

# Relative tolerance per dtype, as a fraction of the reference's largest magnitude:
TOL = {
    torch.float64: 1e-10,  # float64 GEMMs over K <= 1024: ~1e-14 in practice
    torch.float32: 2e-5,  # fp32 accumulation over K <= 1024 (~sqrt(K) * 6e-8) + erf/tanh ulps
    torch.float16: 4e-3,  # y, the saved pre-activation and dL/du are each rounded (2^-11)
    torch.bfloat16: 3e-2,  # same roundings with an 8-bit mantissa (2^-8 = 3.9e-3 each)
}


def _data(M, K, N, dtype, bias=True, lead=None, noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (*(lead or ()), M, K)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * K**-0.5
    b = torch.randn(N, generator=g, dtype=torch.float64) * 0.5 if bias else None
    if noncontig:  # column-major x (last two dims) and weight: transposed views
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        w = w.t().contiguous().t()
    return [None if t is None else t.to(dtype) for t in (x, w, b)]


def _gelu_and_slope(u: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GeLU(u) and GeLU'(u) in float64 from their formulas: exact, u Phi(u) with derivative
    Phi(u) + u phi(u); tanh form, u/2 (1 + tanh(a)) with a = sqrt(2/pi) (u + 0.044715 u^3)."""
    if approximate == "none":
        cdf = 0.5 * (1.0 + torch.erf(u / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * u * u) / math.sqrt(2.0 * math.pi)
        return u * cdf, cdf + u * pdf
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * (u + 0.044715 * u**3))
    return 0.5 * u * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * c * (
        1.0 + 3 * 0.044715 * u * u
    )


def _oracle(x, w, b, approximate, g=None):
    """(y, {"dx", "dw", "db"}) of y = gelu(x w^T + b) and of the loss sum(g * y), in float64
    with the gradients written out: du = g * gelu'(u), dx = du w, dw = du^T x, db = sum du."""
    k, n, m = x.shape[-1], w.shape[0], math.prod(x.shape[:-1])
    x2 = x.detach().double().reshape(m, k)  # (M, K)
    wd = w.detach().double()  # (N, K)
    u = x2 @ wd.t()  # (M, K) @ (K, N)
    if b is not None:
        u = u + b.detach().double()
    y, slope = _gelu_and_slope(u, approximate)
    grads = {}
    if g is not None:
        du = g.reshape(m, n) * slope  # (M, N)
        grads = {"dx": (du @ wd).reshape(x.shape), "dw": du.t() @ x2, "db": du.sum(0)}
    return y.reshape(*x.shape[:-1], n), grads


def _check(backend, x, w, b, approximate, grads=True):
    dtype = x.dtype
    leaves = [
        t.detach().clone().requires_grad_(grads) if t is not None else None for t in (x, w, b)
    ]
    y = linear_gelu(*leaves, approximate=approximate, backend=backend)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, want = _oracle(x, w, b, approximate, g if grads else None)
    assert y.shape == ref.shape and y.dtype == dtype
    _close(y, ref, dtype, "y")
    if not grads:
        return
    y.backward(g.to(dtype))
    for name, got in zip(("dx", "dw", "db"), leaves, strict=True):
        if got is not None:
            assert got.grad is not None, f"{name}: no gradient reached the input"
            _close(got.grad, want[name], dtype, name)


def _close(got, want, dtype, name):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if want.numel() == 0:
        return
    scale = max(want.abs().max().item(), 1e-3)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{name}: max error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


# ---------------------------------------------------------------------------- CPU + reference
CPU_CASES = [  # (M, K, N, dtype)
    (1, 769, 1000, torch.float64),
    (7, 1000, 769, torch.float64),
    (123, 256, 512, torch.float64),
    (1, 769, 1000, torch.float32),
    (7, 1000, 769, torch.float32),
    (123, 256, 512, torch.float32),
    (1024, 769, 1000, torch.float32),
    (7, 769, 256, torch.bfloat16),
    (123, 256, 1000, torch.bfloat16),
    (7, 256, 769, torch.float16),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("M,K,N,dtype", CPU_CASES)
def test_cpu_backends_match_float64(backend, M, K, N, dtype):
    for approximate, bias in (("none", True), ("tanh", False)):
        if M == 1024 and approximate == "tanh":
            continue  # the big shape once is enough (time)
        _check(backend, *_data(M, K, N, dtype, bias=bias), approximate)


@pytest.mark.parametrize("backend", ["cpu", "reference", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_3d_noncontiguous_and_inference(backend, dtype):
    x, w, b = _data(33, 96, 80, dtype, lead=(3,), noncontig=True)
    assert not x.is_contiguous() and not w.is_contiguous()
    for approximate in ("none", "tanh"):
        _check(backend, x, w, b, approximate)
        with torch.no_grad():  # inference path (oneDNN GeLU post-op on CPU, no saved pre)
            _check(backend, x, w, b, approximate, grads=False)


@pytest.mark.parametrize("backend", ["cpu", "triton", "auto"])
def test_partial_grads(backend):
    for bias in (True, False):  # only weight (and bias) need a gradient, as in a first layer
        x, w, b = _data(7, 64, 48, torch.float32 if backend == "triton" else torch.float64, bias)
        w.requires_grad_()
        if b is not None:
            b.requires_grad_()
        y = linear_gelu(x, w, b, backend=backend)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        y.backward(g.to(y.dtype))
        _, want = _oracle(x, w, b, "none", g)
        _close(w.grad, want["dw"], x.dtype, "dw")
        if b is not None:
            _close(b.grad, want["db"], x.dtype, "db")


@pytest.mark.parametrize("pinned", PINNED)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cpu_backend_with_each_gemm_library(monkeypatch, pinned, approximate):
    """The cpu backend in float32 with each GEMM library pinned: training (bias fused into
    the GEMM), and inference, where oneDNN applies the GeLU as its post-op. Otherwise which
    library runs is measured on first use, so a test could run only one of them."""
    real, asked = backend_choice.lookup, []

    def lookup(key, device):
        if key.startswith("cpu_gemm|"):
            asked.append(key.split("|")[1])
            return pinned
        return real(key, device)

    monkeypatch.setattr(backend_choice, "lookup", lookup)
    x, w, b = _data(33, 96, 80, torch.float32, lead=(3,), noncontig=True)
    _check("cpu", x, w, b, approximate)
    with torch.no_grad():
        _check("cpu", x, w, b, approximate, grads=False)
    assert {"linear", f"linear_gelu_{approximate}"} <= set(asked), asked


GEMM_DGELU_SHAPES = [  # (M, P, N): dy (M, P) @ weight (P, N) -> gu (M, N); the interpreter's
    (37, 45, 70),  # tiles are 16 rows by 32-64 columns with K steps of 32: several of each
    (5, 8, 33),
]


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("M,P,N", GEMM_DGELU_SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gemm_dgelu_matches_float64(backend, M, P, N, approximate):
    """The fused MLP's backward GEMM, ``gu = (dy @ w2) * gelu'(pre)`` and ``db = gu.sum(0)``,
    against its formula in float64, with a strided ``dy`` (a transposed view)."""
    dtype = torch.float32 if backend == "triton" else torch.float64
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(P, M, generator=g, dtype=torch.float64).t()  # (M, P), not contiguous
    w2 = torch.randn(P, N, generator=g, dtype=torch.float64) * P**-0.5
    pre = torch.randn(M, N, generator=g, dtype=torch.float64)
    want = (dy @ w2) * _gelu_and_slope(pre, approximate)[1]  # (M, P) @ (P, N)
    for bias_grad in (True, False):
        gu, db = gemm_dgelu(dy.to(dtype), w2.to(dtype), pre.to(dtype), bias_grad=bias_grad,
                            approximate=approximate, backend=backend)
        _close(gu, want, dtype, "gu")
        if bias_grad:
            _close(db, want.sum(0), dtype, "db")
        else:
            assert db is None


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton", "auto"])
def test_1d_and_empty_dimensions(backend):
    for lead, K, N in (((), 8, 5), ((0,), 8, 5), ((3,), 0, 5), ((2, 3), 8, 0)):
        x = torch.randn(*lead, K)
        w = torch.randn(N, K)
        b = torch.randn(N)
        _check(backend, x, w, b, "none")


# ---------------------------------------------------------------------------- Triton
def _triton_runs_here() -> bool:
    return backends()["triton"].startswith("ok") and not torch.cuda.is_available()


TRITON_SHAPES = [(1, 45, 37), (7, 64, 32), (123, 33, 70)]  # interpreter: keep them small


@pytest.mark.parametrize("M,K,N", TRITON_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_interpreter_matches_float64(M, K, N, dtype):
    assert _triton_runs_here(), backends()["triton"]  # conftest sets TRITON_INTERPRET=1
    for approximate, bias in (("none", True), ("tanh", True), ("none", False), ("tanh", False)):
        _check("triton", *_data(M, K, N, dtype, bias=bias), approximate)


def test_triton_3d_noncontiguous():
    x, w, b = _data(9, 40, 24, torch.float32, lead=(2,), noncontig=True)
    _check("triton", x, w, b, "none")
    with torch.no_grad():
        _check("triton", x, w, b, "tanh", grads=False)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton", "auto"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_strided_bias(backend, approximate):
    """A bias that is every other entry of a packed vector (stride 2), the entries between
    them large, so that reading the bias with unit stride cannot pass."""
    dtype = torch.float32 if backend == "triton" else torch.float64  # interpreter: no fp64
    x, w, b = _data(7, 40, 24, dtype)
    packed = torch.stack([b, torch.full_like(b, 50.0)], -1).requires_grad_()  # (N, 2)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    bias = packed[:, 0]
    assert bias.stride() == (2,)
    with torch.no_grad():  # inference path (no saved pre-activation)
        y0 = linear_gelu(x, w, bias, approximate=approximate, backend=backend)
    y = linear_gelu(xl, wl, bias, approximate=approximate, backend=backend)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, want = _oracle(x, w, b, approximate, g)
    _close(y0, ref, dtype, "y (no grad)")
    _close(y, ref, dtype, "y")
    y.backward(g.to(dtype))
    _close(xl.grad, want["dx"], dtype, "dx")
    _close(wl.grad, want["dw"], dtype, "dw")
    _close(packed.grad[:, 0], want["db"], dtype, "db")
    assert packed.grad[:, 1].eq(0).all(), "gradient reached the entries between the bias"


# ---------------------------------------------------------------------------- registration
@pytest.mark.parametrize("backend", ["cpu", "auto", "triton"])
def test_opcheck(backend):
    x, w, b = _data(7, 40, 24, torch.float32)
    for t in (x, w, b):
        t.requires_grad_()
    for bias in (b, None):
        for save_pre in (True, False):
            torch.library.opcheck(
                torch.ops.distllm.linear_gelu_fwd.default, (x, w, bias, "tanh", backend, save_pre)
            )
    g = torch.randn(7, 24)
    pre = F.linear(x, w, b).detach()
    torch.library.opcheck(
        torch.ops.distllm.linear_gelu_bwd.default,
        (g, x.detach(), w.detach(), pre, b.detach(), "none", backend, True, True),
    )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_second_derivatives(backend, approximate, bias):
    """Differentiable twice on every backend (a Hessian-vector product, a gradient penalty):
    gradgradcheck, float64."""
    x, w, b = _data(5, 6, 4, torch.float64)
    args = [t.requires_grad_() for t in ((x, w, b) if bias else (x, w))]

    def f(x, w, b=None):
        return linear_gelu(x, w, b, approximate=approximate, backend=backend)

    assert torch.autograd.gradgradcheck(f, args)
    # only some first derivatives asked for: x's alone
    y = f(*args)
    (gx,) = torch.autograd.grad(y.square().sum(), args[0], create_graph=True)
    (hw,) = torch.autograd.grad(gx.sum(), args[1])
    y = linear_gelu_reference(*args, approximate=approximate)
    (rx,) = torch.autograd.grad(y.square().sum(), args[0], create_graph=True)
    (rw,) = torch.autograd.grad(rx.sum(), args[1])
    assert torch.allclose(hw, rw, rtol=1e-10, atol=1e-12)


def test_torch_compile_fullgraph():
    x, w, b = _data(5, 32, 16, torch.float64)
    for t in (x, w, b):
        t.requires_grad_()

    def f(x, w, b):
        return linear_gelu(x, w, b, approximate="tanh", backend="cpu").sum()

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b)
    out.backward()
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    f_ref = linear_gelu_reference(*ref, approximate="tanh").sum()
    f_ref.backward()
    torch.testing.assert_close(out, f_ref, rtol=1e-12, atol=1e-12)
    for t, r in zip((x, w, b), ref, strict=True):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- auto + errors
def test_auto_measures_once_and_never_picks_the_interpreter(monkeypatch):
    backend_choice.clear()
    calls = []
    real = backend_choice.measure

    def counting(cands, sync, reps=5):
        calls.append(sorted(cands))
        return real(cands, sync, reps)

    monkeypatch.setattr(backend_choice, "measure", counting)
    x, w, b = _data(17, 48, 40, torch.float32)
    y1 = linear_gelu(x, w, b)
    y2 = linear_gelu(x, w, b)
    # the backend measured once, triton (interpreter) not a candidate; inside the cpu
    # backend, its GEMM (oneDNN or torch's) measured once too
    assert calls[0] == ["cpu", "reference"]
    assert calls[1:] == [["onednn", "torch"]] * len(calls[1:]) and len(calls) <= 2
    chosen = [v for k, v in backend_choice.cached().items() if "|linear_gelu|" in k]
    assert len(chosen) == 1 and chosen[0] in ("cpu", "reference")
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    _close(y1, _oracle(x, w, b, "none")[0], x.dtype, "y")


def test_backends_report_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rep = backends()
    assert set(rep) == {"cuda", "triton", "cpu", "reference"}
    assert rep["reference"].startswith("ok") and rep["cpu"].startswith("ok")
    assert rep["cuda"] == "unavailable: no CUDA device is visible to torch", rep["cuda"]
    if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no GPU
        assert rep["triton"].startswith("unavailable: no CUDA device"), rep["triton"]
        return
    from distllm.kernels.linear_gelu import interpreter_problem

    problem = interpreter_problem()  # e.g. Triton 3.6's interpreter with numpy >= 2.4
    if problem is None:
        assert rep["triton"].startswith("ok: through TRITON_INTERPRET=1"), rep["triton"]
    else:
        assert rep["triton"] == f"unavailable: {problem}", rep["triton"]


@pytest.mark.gpu
def test_gpu_backends_report():
    rep = backends()  # bench/gpu_check.sh builds distllm._cuda before running this
    assert rep["cuda"].startswith("ok") and "approximate='tanh'" in rep["cuda"], rep["cuda"]
    assert rep["triton"].startswith("ok: autotuned"), rep["triton"]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x, w, b: linear_gelu(x, torch.randn(16, 31), b), "in_features"),
        (lambda x, w, b: linear_gelu(x, w[0], b), "2-D"),
        (lambda x, w, b: linear_gelu(x, w[None], b), "2-D"),
        (lambda x, w, b: linear_gelu(x, w, b[:-1]), "length out_features=16"),
        (lambda x, w, b: linear_gelu(x, w, b[None]), "1-D"),
        (lambda x, w, b: linear_gelu(x, w.double(), b), "one dtype"),
        (lambda x, w, b: linear_gelu(x, w, b.bfloat16()), "one dtype"),
        (lambda x, w, b: linear_gelu(x, w, b.to("meta")), "one device"),
        (lambda x, w, b: linear_gelu(x, w, b, approximate="erf"), "approximate"),
        (lambda x, w, b: linear_gelu(x, w, b, backend="fastest"), "backend"),
        (lambda x, w, b: linear_gelu(x.long(), w.long(), None), "floating"),
        (lambda x, w, b: linear_gelu(x.double(), w.double(), None, backend="triton"), "float32"),
        # gemm_dgelu: dy (4, 16) @ w (16, 32) into pre (4, 32)
        (lambda x, w, b: gemm_dgelu(torch.randn(4, 16), w.double(), x, backend="cpu"),
         r"gemm_dgelu: dy, weight and pre must share one dtype, got dy=torch.float32, "
         r"weight=torch.float64, pre=torch.float32"),
    ],
)
def test_bad_input(make, match):
    x, w, b = torch.randn(4, 32), torch.randn(16, 32), torch.randn(16)
    with pytest.raises(ValueError, match=match):
        make(x, w, b)


def test_unavailable_backend_names_the_available_ones():
    x, w = torch.randn(4, 32), torch.randn(16, 32)  # CPU tensors: 'cuda' cannot serve them
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run here.*Available.*cpu"):
        linear_gelu(x, w, backend="cuda")
    # the custom ops called directly check too (cuBLASLt would run tanh for an exact GeLU)
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run here.*Available.*cpu"):
        torch.ops.distllm.linear_gelu_fwd(x, w, None, "none", "cuda", True)
    pre = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run here.*Available.*cpu"):
        torch.ops.distllm.linear_gelu_bwd(pre, x, w, pre, None, "none", "cuda", True, True)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_backends_match_float64(backend, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after
    for M, K, N in ((1, 768, 1024), (123, 1024, 512), (1024, 768, 1000)):
        for approximate, bias in (("tanh", True), ("tanh", False), ("none", True)):
            if backend == "cuda" and (approximate == "none" or N % 8):
                continue  # cuBLASLt serves tanh with 8-aligned sizes; checked below
            x, w, b = (None if t is None else t.cuda() for t in _data(M, K, N, dtype, bias))
            _check(backend, x, w, b, approximate)


@pytest.mark.gpu
def test_gpu_cuda_backend_refuses_erf():
    x, w = torch.randn(8, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    with pytest.raises(ValueError, match="tanh"):
        linear_gelu(x, w, approximate="none", backend="cuda")


@pytest.mark.gpu
def test_gpu_dgelu_bgrad_op():
    g = torch.Generator().manual_seed(0)
    dy, w2, pre = (torch.randn(s, generator=g).cuda() for s in ((64, 32), (32, 48), (64, 48)))
    dpre, db = extensions.load("_cuda").cublaslt_dgelu_bgrad(dy, w2, pre)
    pd = pre.double().requires_grad_()
    F.gelu(pd, approximate="tanh").backward(dy.double() @ w2.double())
    torch.testing.assert_close(dpre.double(), pd.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db.double(), pd.grad.sum(0), rtol=1e-4, atol=1e-3)


def test_auto_first_call_inside_activation_checkpointing():
    # auto times its candidates on the first call of a shape; inside a checkpointed region
    # those timing runs must not count as saved tensors, or the recomputation (which hits the
    # cached choice) saves fewer and checkpointing fails
    from torch.utils.checkpoint import checkpoint

    backend_choice.clear()
    x = torch.randn(7, 33, dtype=torch.float64, requires_grad=True)
    w = torch.randn(45, 33, dtype=torch.float64, requires_grad=True)
    b = torch.randn(45, dtype=torch.float64, requires_grad=True)
    y = checkpoint(lambda a: linear_gelu(a, w, b), x, use_reentrant=False)
    y.sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.gelu(F.linear(xr, wr, br)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)  # float64: same math
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=1e-12)


