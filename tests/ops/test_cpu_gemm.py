"""The CPU GEMMs measured against each other (distllm.ops.cpu_gemm): each shape (its rows
rounded up to a power of two) is measured once and the faster library runs from then on;
both libraries give the product (float32, against a float64 oracle), into a given ``out`` as
well; float64, other layouts and fake tensors go to torch's GEMM without measuring."""

from __future__ import annotations

import pytest
import torch

from distllm.ops import backend_choice, cpu_gemm
from tests._onednn import PINNED


@pytest.mark.parametrize("faster", ["onednn", "torch"])
def test_runs_the_gemm_measured_faster(monkeypatch, faster):
    """oneDNN against torch's own GEMM, timed once per GEMM shape (rows rounded up to a power
    of two); the faster runs from then on (neither wins on every CPU and shape)."""
    monkeypatch.setattr(cpu_gemm, "onednn_dtype_ok", lambda dtype: True)  # any torch build
    backend_choice.clear()
    measured = []

    def fake_measure(cands, sync, reps=5):
        measured.append(sorted(cands))
        return {n: (1.0 if n == faster else 2.0) for n in cands}

    monkeypatch.setattr(backend_choice, "measure", fake_measure)
    ran = []
    onednn = lambda: ran.append("onednn") or "o"  # noqa: E731
    plain = lambda: ran.append("torch") or "t"  # noqa: E731
    a, w = torch.randn(6, 8), torch.randn(4, 8)
    first = cpu_gemm.onednn_or_torch("probe", a, w, onednn, plain)
    ran.clear()
    again = cpu_gemm.onednn_or_torch("probe", a, w, onednn, plain)
    assert measured == [["onednn", "torch"]], "not measured exactly once for one shape"
    assert (first, again) == (faster[0],) * 2 and ran == [faster]
    cpu_gemm.onednn_or_torch("probe", torch.randn(8, 8), w, onednn, plain)  # rows 5..8
    assert len(measured) == 1, "a shape in the same bucket of rows measured again"
    cpu_gemm.onednn_or_torch("probe", torch.randn(9, 8), w, onednn, plain)
    assert len(measured) == 2, "a shape in the next bucket reused another's measurement"


def test_measures_nothing_for_fake_or_float64(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend_choice.clear()
    monkeypatch.setattr(backend_choice, "measure", lambda *a, **k: pytest.fail("measured"))
    plain = lambda: "t"  # noqa: E731
    with FakeTensorMode():
        a, w = torch.randn(6, 8), torch.randn(4, 8)
        assert cpu_gemm.onednn_or_torch("probe", a, w, lambda: "o", plain) == "t"
    a64 = torch.randn(6, 8, dtype=torch.float64)
    assert cpu_gemm.onednn_or_torch("probe", a64, a64[:4], lambda: "o", plain) == "t"
    # the products: float64 and non-contiguous operands are torch's, exactly
    w64 = torch.randn(5, 8, dtype=torch.float64)
    assert torch.equal(cpu_gemm.mm_t(a64, w64), a64 @ w64.t())
    assert torch.equal(cpu_gemm.mm(a64.t(), a64), a64.t() @ a64)
    a32, w32 = torch.randn(8, 6).t(), torch.randn(5, 8)  # a (6, 8), strided
    assert torch.equal(cpu_gemm.mm_t(a32, w32), a32 @ w32.t())
    assert not backend_choice.cached(), "a GEMM that is torch's alone was measured"


@pytest.mark.parametrize("pinned", PINNED)
@pytest.mark.parametrize("into", [False, True])
def test_both_libraries_give_the_product(monkeypatch, pinned, into):
    """``mm_t`` (a @ w.T) and ``mm`` (a @ w) with either library pinned, with and without
    ``out``, against the float64 product (fp32 accumulation over K = 96)."""
    monkeypatch.setattr(backend_choice, "lookup", lambda key, device: pinned)
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(37, 96, generator=g), torch.randn(53, 96, generator=g)
    gy = torch.randn(37, 53, generator=g)
    want_t = a.double() @ w.double().t()
    want = gy.double() @ w.double()
    buf_t, buf = torch.full((40, 53), 7.0), torch.full((40, 96), 7.0)
    got_t = cpu_gemm.mm_t(a, w, out=buf_t[1:38] if into else None)
    got = cpu_gemm.mm(gy, w, out=buf[1:38] if into else None)
    for g_, w_ in ((got_t, want_t), (got, want)):
        assert g_.dtype == torch.float32
        torch.testing.assert_close(g_.double(), w_, rtol=0, atol=2e-5 * w_.abs().max().item())
    if into:  # written into the given rows, nothing around them
        assert got_t.data_ptr() == buf_t[1:38].data_ptr() and got.data_ptr() == buf[1:38].data_ptr()
        for b in (buf_t, buf):
            assert bool((b[0] == 7).all()) and bool((b[38:] == 7).all())
