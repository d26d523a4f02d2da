"""linear_gelu on CUDA tensors, every backend that serves them (``cuda`` = cuBLASLt epilogues,
``triton``, ``reference``, and ``auto``; ``cpu`` is refused for CUDA tensors), against a
float64 reference with per-dtype tolerances: odd sizes (1, 7, 123, 769), 3-D and
non-contiguous inputs, inference and training (where cuBLASLt must serve them, a fallback to
another backend fails the test); each cuBLASLt kernel and epilogue in each dtype, on
pointers aligned to 16 bytes only, and with an empty reduction; TF32 on and off, the
fallback when cuBLASLt has no algorithm, and the
Triton tuning switch the GPU check sets (DISTLLM_TRITON_TUNE=min)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from distllm.ops import backend_choice, extensions, linear_gelu, linear_gelu_reference
from distllm.ops import linear_gelu_backends as impl
from tests._errors import worst

pytestmark = pytest.mark.gpu

# Relative tolerance per dtype, as a fraction of the reference's largest magnitude:
TOL = {
    torch.float32: 2e-5,  # fp32 accumulation (TF32 off) over K <= 1000 + erf/tanh ulps
    torch.float16: 4e-3,  # y, the saved pre-activation and dL/du are each rounded (2^-11)
    torch.bfloat16: 3e-2,  # the same roundings with an 8-bit mantissa (2^-8 = 3.9e-3 each)
}
TF32_TOL = 5e-3  # inputs rounded to a 10-bit mantissa (2^-11) before an fp32-accumulated dot
# cuBLASLt needs in/out features that are multiples of 8; the other backends take any size
ALIGNED = [(1, 768, 1024), (7, 1000, 512), (123, 256, 776), (769, 512, 1024)]
ODD = [(1, 769, 123), (7, 123, 769), (123, 769, 7), (769, 7, 123)]


@pytest.fixture(autouse=True)
def _fp32_is_fp32():
    assert torch.cuda.is_available(), "needs CUDA (run through bench/gpu_check.sh)"
    assert extensions.load("_cuda") is not None, extensions.status("_cuda")  # the cuBLASLt ops
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _data(M, K, N, dtype, bias=True, lead=(), noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * K**-0.5
    b = torch.randn(N, generator=g, dtype=torch.float64) * 0.5 if bias else None
    x, w = x.to(dtype).cuda(), w.to(dtype).cuda()
    if noncontig:  # column-major x (last two dims) and weight: transposed views
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        w = w.t().contiguous().t()
    return x, w, (b.to(dtype).cuda() if bias else None)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.numel() == 0:
        return 0.0
    scale = max(want.abs().max().item(), 1e-3)
    return (got.double() - want).abs().max().item() / scale


def _errors(backend, x, w, b, approximate, grads=True) -> dict[str, float]:
    """Relative max errors of y (and dx, dw, db) against float64 autograd."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(grads) for t in (x, w, b)]
    refs = [None if t is None else t.detach().double().requires_grad_(grads) for t in (x, w, b)]
    y = linear_gelu(*leaves, approximate=approximate, backend=backend)
    ref = linear_gelu_reference(*refs, approximate=approximate)
    assert y.is_cuda and y.dtype == x.dtype
    errs = {"y": _err(y, ref)}
    if grads:
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y.backward(g.to(y.dtype).cuda())
        ref.backward(g.cuda())
        for name, got, want in zip(("dx", "dw", "db"), leaves, refs, strict=True):
            if got is not None:
                errs[name] = _err(got.grad, want.grad)
    return errs


def _cases(backend):
    """Every (approximate, bias) combination on the first shape, then one per shape in turn
    (each new combination is a Triton compile; the GPU check has minutes, not hours)."""
    shapes = ALIGNED if backend == "cuda" else ALIGNED + ODD
    combos = [("tanh", True), ("tanh", False)]
    if backend != "cuda":  # cuBLASLt's GeLU epilogue is the tanh form
        combos += [("none", True), ("none", False)]
    first = [(shapes[0], a, b) for a, b in combos]
    return first + [(s, *combos[i % len(combos)]) for i, s in enumerate(shapes[1:])]


def _no_fallback(monkeypatch) -> list[str]:
    """A cuBLASLt call that raises NotImplementedError would run the next backend and give
    the right numbers: where cuBLASLt must serve the inputs, each fallback is recorded in the
    list returned (and raised, which ``auto``'s timing would catch: hence the list), and
    the test asserts it empty."""
    fell = []

    def fell_back(x, w, approximate, phase, exc):
        fell.append(f"{phase}: {exc}")
        raise AssertionError(f"cuBLASLt fell back in {phase}: {exc}")

    monkeypatch.setattr(impl, "_after_cuda", fell_back)
    return fell


@pytest.mark.parametrize("backend", ["cuda", "triton", "reference", "auto"])
@pytest.mark.parametrize("dtype", list(TOL))
def test_backends_match_float64(backend, dtype, monkeypatch):
    # auto sends cuBLASLt only the inputs it can serve
    fell = _no_fallback(monkeypatch) if backend in ("cuda", "auto") else []
    bad = {}
    for (M, K, N), approximate, bias in _cases(backend):
        errs = _errors(backend, *_data(M, K, N, dtype, bias), approximate)
        if worst(errs.values()) > TOL[dtype]:
            bad[(M, K, N, approximate, bias)] = errs
    assert not bad, f"tolerance {TOL[dtype]}: {bad}"
    assert fell == [], fell


@pytest.mark.parametrize("backend", ["cuda", "triton", "reference", "auto"])
@pytest.mark.parametrize("dtype", list(TOL))
def test_3d_noncontiguous_training_and_inference(backend, dtype, monkeypatch):
    fell = _no_fallback(monkeypatch) if backend in ("cuda", "auto") else []
    x, w, b = _data(33, 96, 80, dtype, lead=(3,), noncontig=True)
    assert not x.is_contiguous() and not w.is_contiguous()
    for approximate in ("tanh",) if backend == "cuda" else ("tanh", "none"):
        errs = _errors(backend, x, w, b, approximate)
        with torch.no_grad():  # no saved pre-activation: GELU_BIAS epilogue on cuBLASLt
            errs.update(
                {
                    f"{k} (no grad)": v
                    for k, v in _errors(backend, x, w, b, approximate, grads=False).items()
                }
            )
        assert worst(errs.values()) <= TOL[dtype], errs
    assert fell == [], fell


def test_cpu_backend_refuses_cuda_tensors():
    x, w, b = _data(7, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=r"backend='cpu' cannot run here.*cuda, triton"):
        linear_gelu(x, w, b, approximate="tanh", backend="cpu")
    with pytest.raises(ValueError, match="tanh"):
        linear_gelu(x, w, b, approximate="none", backend="cuda")


def test_auto_never_picks_cpu_on_cuda():
    backend_choice.clear()
    x, w, b = _data(123, 256, 776, torch.bfloat16)
    errs = _errors("auto", x, w, b, "tanh")
    assert worst(errs.values()) <= TOL[torch.bfloat16], errs
    # the fused op's choice for this problem (its key built as the dispatch builds it)
    key = f"|linear_gelu|torch.bfloat16|{backend_choice.gemm_shape_key(x, w)}|"
    chosen = {k: v for k, v in backend_choice.cached().items() if key in k}
    assert chosen and set(chosen.values()) <= {"cuda", "triton", "reference"}, chosen


def _offset(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A copy of ``t`` whose data starts ``nbytes`` past a 256-byte-aligned allocation."""
    n = nbytes // t.element_size()
    buf = torch.empty(t.numel() + n, dtype=t.dtype, device=t.device)
    out = buf[n:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 256 == nbytes % 256
    return out


@pytest.mark.parametrize("dtype", list(TOL))
def test_cublaslt_ops_on_16_byte_aligned_pointers(dtype):
    # the dispatch guarantees 16 bytes; cuBLASLt assumes 256 unless told the real alignment
    x, w, b = _data(123, 256, 776, dtype)
    x16, w16, b16 = (_offset(t, 16) for t in (x, w, b))
    y, pre = extensions.load("_cuda").cublaslt_linear_gelu(x16, w16, b16, True)
    pre_ref = F.linear(x.double(), w.double(), b.double())
    assert _err(pre, pre_ref) <= TOL[dtype]
    assert _err(y, F.gelu(pre_ref, approximate="tanh")) <= TOL[dtype]
    gu = torch.randn_like(pre)
    dw, db = extensions.load("_cuda").cublaslt_wgrad_bgrad(_offset(gu, 16), x16, True)
    assert _err(dw, gu.double().t() @ x.double()) <= TOL[dtype]
    assert _err(db, gu.double().sum(0)) <= TOL[dtype]


def test_cublaslt_two_byte_aligned_is_correct_or_refused():
    # 2-byte alignment: cuBLASLt either has a kernel for it (the result must be right) or
    # none (a NotImplementedError that names the alignments), never a wrong answer
    x, w, b = _data(64, 256, 512, torch.bfloat16)
    x2 = _offset(x, 2)
    want = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    try:
        y, _ = extensions.load("_cuda").cublaslt_linear_gelu(x2, w, b, False)
    except NotImplementedError as exc:
        assert "no algorithm" in str(exc) and "alignments" in str(exc)
    else:
        assert _err(y, want) <= TOL[torch.bfloat16]
    # the public op always answers (its dispatch realigns, or falls back)
    y = linear_gelu(x2, w, b, approximate="tanh", backend="cuda")
    assert _err(y, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_tf32_flag_reaches_the_kernel(backend):
    x, w, b = _data(512, 1024, 1024, torch.float32)
    want = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    errs = {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        y, _ = impl.fwd(backend, x, w, b, "tanh", False)
        errs[tf32] = _err(y, want)
    assert errs[False] <= TOL[torch.float32], errs
    # TF32 rounds the inputs to 10 mantissa bits: visibly coarser than fp32, still close
    assert 10 * errs[False] < errs[True] <= TF32_TOL, errs


def test_cuda_backend_falls_back_when_cublaslt_has_no_algorithm(monkeypatch, caplog):
    def no_algorithm(*args):
        raise NotImplementedError("cuBLASLt found no algorithm for epilogue (test)")

    monkeypatch.setattr(impl, "_cublaslt_fwd", no_algorithm)
    monkeypatch.setattr(impl, "_cublaslt_wgrad", no_algorithm)
    monkeypatch.setattr(impl, "_fallback_warned", set())
    x, w, b = _data(123, 256, 776, torch.float32)
    with caplog.at_level(logging.WARNING, logger="distllm"):
        for _ in range(2):
            errs = _errors("cuda", x, w, b, "tanh")
            assert worst(errs.values()) <= TOL[torch.float32], errs
    warned = [r.getMessage() for r in caplog.records if "no algorithm" in r.getMessage()]
    assert len(warned) == 2, warned  # once for the forward, once for the backward
    assert "instead" in warned[0]


@pytest.mark.parametrize("dtype", list(TOL))
def test_each_cublaslt_kernel_and_epilogue_in_each_dtype(dtype):
    # the kernels themselves, not through the dispatch (whose fallback would hide a refusal):
    # GELU_AUX_BIAS, GELU_AUX, GELU_BIAS, GELU; DGELU_BGRAD; BGRADB and the plain dW GEMM
    kernels = extensions.load("_cuda")
    x, w, b = _data(123, 256, 776, dtype)
    xd, wd, bd = x.double(), w.double(), b.double()
    for bias in (b, None):
        pre_ref = F.linear(xd, wd, None if bias is None else bd)
        for save_pre in (True, False):
            y, pre = kernels.cublaslt_linear_gelu(x, w, bias, save_pre)
            assert _err(y, F.gelu(pre_ref, approximate="tanh")) <= TOL[dtype], (bias, save_pre)
            if save_pre:
                assert _err(pre, pre_ref) <= TOL[dtype], bias
            else:
                assert pre.numel() == 0
    gu = torch.randn(123, 776, dtype=dtype, device="cuda")
    for with_bias in (True, False):
        dw, db = kernels.cublaslt_wgrad_bgrad(gu, x, with_bias)
        assert _err(dw, gu.double().t() @ xd) <= TOL[dtype]
        if with_bias:
            assert _err(db, gu.double().sum(0)) <= TOL[dtype]
        else:
            assert db.numel() == 0
    g = torch.Generator().manual_seed(0)
    dy, w2, pre = (
        torch.randn(s, generator=g, dtype=torch.float64) for s in ((123, 32), (32, 776), (123, 776))
    )
    dpre, db = kernels.cublaslt_dgelu_bgrad(*(t.to(dtype).cuda() for t in (dy, w2, pre)))
    pd = pre.to(dtype).double().requires_grad_()
    F.gelu(pd, approximate="tanh").backward(dy.to(dtype).double() @ w2.to(dtype).double())
    assert _err(dpre.cpu(), pd.grad) <= TOL[dtype]
    assert _err(db.cpu(), pd.grad.sum(0)) <= TOL[dtype]


def test_gemm_dgelu_on_cublaslt_needs_a_reduction_that_is_a_multiple_of_8():
    from distllm.ops import gemm_dgelu

    dy, w2, pre = (torch.randn(s, device="cuda") for s in ((64, 12), (12, 64), (64, 64)))
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm_dgelu(dy, w2, pre, approximate="tanh", backend="cuda")


def test_cublaslt_kernels_with_an_empty_reduction():
    # K = 0 (no dW GEMM: the bias gradient is still gpre's column sums) and P = 0 (dy @ w2 is
    # 0: so are dpre and its sum)
    kernels = extensions.load("_cuda")
    gpre = torch.randn(16, 24, device="cuda")
    dw, db = kernels.cublaslt_wgrad_bgrad(gpre, torch.empty(16, 0, device="cuda"), True)
    assert dw.shape == (24, 0) and torch.allclose(db, gpre.sum(0))
    dpre, db = kernels.cublaslt_dgelu_bgrad(torch.empty(16, 0, device="cuda"),
                                            torch.empty(0, 24, device="cuda"),
                                            torch.randn(16, 24, device="cuda"))
    assert dpre.shape == (16, 24) and not dpre.any() and not db.any()


def test_triton_tuning_switch():
    from distllm.kernels import linear_gelu as k
    from distllm.kernels import linear_gelu_tuning as tuning

    n = len(k._fwd.configs)
    if os.environ.get("DISTLLM_TRITON_TUNE") == "min":
        assert n == 1
    else:
        assert n == len(tuning.fwd_configs()) > 1
