"""``backend="auto"`` measures once per bucket of rows, not once per exact shape
(:mod:`distllm.ops.backend_choice`): the GEMM's rows M (an input's leading dimensions
flattened) rounded up to a power of two, as the overlap tuner rounds them, the other
dimensions, dtype and flags exact. Batches of varying sequence length (packed, variable
length) then reuse one measurement per bucket: the fused op's whole-call choice, its per-phase
choices (the op called with "auto", as under ``torch.compile``), and the CPU GEMM library's.
Every result is compared against a float64 reference; float32 inputs, the dtype that is
measured on CPU (float64 runs torch's GEMM without measuring)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from distllm.ops import backend_choice, cpu_gemm, linear_gelu
from tests._onednn import ONEDNN

# float32 GEMMs over K = 37 (~sqrt(K) * 6e-8 relative) plus erf's ulps, as a fraction of the
# reference's largest magnitude: a few 1e-7; a wrong or missing product is O(1) off
RTOL_F32 = 2e-5
K, N = 37, 53
# row counts in the bucket (32, 64], as the inputs' leading dimensions: 3-D, 2-D, 4-D
SAME_BUCKET = [(3, 11), (47,), (2, 4, 8)]  # 33, 47 and 64 rows
NEXT_BUCKET = (5, 13)  # 65 rows: the bucket (64, 128]


def _data(lead, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * K**-0.5
    b = torch.randn(N, generator=g, dtype=torch.float64) * 0.5
    return x, w, b


def _close(got, want, what):
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < RTOL_F32, f"{what}: relative error {err:.3g} against the float64 reference"


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The candidate names of every measurement, in order (the real measurement runs); the
    choices go to a cache file of this test's own."""
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
    backend_choice.clear()
    calls, real = [], backend_choice.measure

    def counting(cands, sync, reps=3):
        calls.append(sorted(cands))
        return real(cands, sync, reps)

    monkeypatch.setattr(backend_choice, "measure", counting)
    yield calls
    backend_choice.clear()


def _counts(calls) -> tuple[int, int]:
    """(the fused op's backend measurements, the CPU GEMM library's)."""
    gemm = sum(c == ["onednn", "torch"] for c in calls)
    return len(calls) - gemm, gemm


def _file_keys(tmp_path) -> list[str]:
    path = tmp_path / "tune.json"  # (none where nothing was measured)
    return sorted(json.loads(path.read_text())) if path.exists() else []


def test_rows_bucket_is_the_overlap_tuners_rounding():
    """The overlap tuner's keys (distllm.parallel.tensor.layers.OverlapPlan) round the rows up
    to a power of two as ``1 << max(m - 1, 0).bit_length()``; the backend choice's do the
    same, except that an empty problem keeps a key of its own."""
    for m in range(1, 1100):
        assert backend_choice.rows_bucket(m) == 1 << max(m - 1, 0).bit_length(), m
    assert [backend_choice.rows_bucket(m) for m in (0, 1, 2, 3, 33, 64, 65)] == [
        0, 1, 2, 4, 64, 64, 128]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_linear_gelu_auto_measures_once_per_row_bucket(measured, tmp_path, grad):
    """linear_gelu(backend="auto") at 33, 47 and 64 rows measures once (at 33 rows: the first
    call of the bucket, on its own tensors), at 65 rows once more; the cache file holds one
    set of choices per bucket, not one per length; every output (and gradient) is right."""
    after = []
    for lead in [*SAME_BUCKET, NEXT_BUCKET]:
        x, w, b = _data(lead)
        xs, ws, bs = (t.float().requires_grad_(grad) for t in (x, w, b))
        with torch.set_grad_enabled(grad):
            y = linear_gelu(xs, ws, bs)
        xd, wd, bd = (t.clone().requires_grad_(grad) for t in (x, w, b))
        want = F.gelu(F.linear(xd, wd, bd))
        _close(y, want.detach(), f"y at rows {lead}")
        if grad:
            gy = torch.randn(want.shape, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(1))
            y.backward(gy.float())
            want.backward(gy)
            for got, ref, name in ((xs, xd, "dx"), (ws, wd, "dw"), (bs, bd, "db")):
                _close(got.grad, ref.grad, f"{name} at rows {lead}")
        after.append((_counts(measured), _file_keys(tmp_path)))
    (first, keys1), (second, keys2), (third, keys3), (nxt, keys4) = after
    assert first[0] == 1, f"the first call measured the backends {first[0]} times: {measured}"
    if ONEDNN:  # the cpu candidate's GEMMs measured their library too (torch has oneDNN)
        assert first[1] >= 1, measured
    assert second == third == first, (
        f"rows 47 and 64 measured again after rows 33 (same bucket): {after}")
    assert keys3 == keys2 == keys1, "the cache file grew within one bucket"
    assert nxt[0] == 2, f"rows 65 (the next bucket) did not measure the backends again: {after}"
    if ONEDNN:
        assert nxt[1] > first[1], f"rows 65 did not measure the GEMM library again: {after}"
    assert sum("|linear_gelu|" in k for k in keys4) == 2
    assert any("(rows<=64, 37)x(53, 37)" in k for k in keys1), keys1


def test_the_op_called_with_auto_measures_once_per_row_bucket(measured):
    """The registered forward and backward called with "auto" (torch.compile's path: the
    choice per phase inside the op) measure once per bucket of rows, each phase."""
    keys = []
    for lead in [*SAME_BUCKET, NEXT_BUCKET]:
        x, w, b = _data(lead)
        x2 = x.reshape(-1, K)
        xs, ws, bs = (t.float() for t in (x2, w, b))
        y, pre = torch.ops.distllm.linear_gelu_fwd(xs, ws, bs, "none", "auto", True)
        want_pre = F.linear(x2, w, b)
        _close(y, F.gelu(want_pre), f"y at rows {lead}")
        _close(pre, want_pre, f"pre at rows {lead}")
        gy = torch.randn(x2.shape[0], N, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
        dx, dw, db = torch.ops.distllm.linear_gelu_bwd(gy.float(), xs, ws, pre, bs, "none",
                                                        "auto", True, True)
        xd, wd, bd = (t.clone().requires_grad_() for t in (x2, w, b))
        F.gelu(F.linear(xd, wd, bd)).backward(gy)
        for got, ref, name in ((dx, xd, "dx"), (dw, wd, "dw"), (db, bd, "db")):
            _close(got, ref.grad, f"{name} at rows {lead}")
        keys.append(sorted(k.split("|")[2] for k in backend_choice.cached()
                           if k.split("|")[2] in ("linear_gelu_fwd", "linear_gelu_bwd")))
    assert keys[0] == keys[1] == keys[2] == ["linear_gelu_bwd", "linear_gelu_fwd"], keys
    assert keys[3] == ["linear_gelu_bwd"] * 2 + ["linear_gelu_fwd"] * 2, keys
    phases = [c for c in measured if c != ["onednn", "torch"]]
    assert len(phases) == 4, f"not one forward and one backward measurement per bucket: {phases}"


def test_cpu_gemm_measures_once_per_row_bucket(measured, tmp_path):
    """The CPU GEMM library (oneDNN or torch's) of ``mm_t`` (a @ w.T) and ``mm`` (a @ w) is
    measured once per kind and bucket of rows: at 33 rows, not again at 47 or 64, again at 65;
    the products equal the float64 ones. A torch without oneDNN's float32 linear has one
    library and measures nothing."""
    counts = []
    for rows in (33, 47, 64, 65):
        g = torch.Generator().manual_seed(rows)
        a = torch.randn(rows, K, generator=g, dtype=torch.float64)
        w = torch.randn(N, K, generator=g, dtype=torch.float64)
        gy = torch.randn(rows, N, generator=g, dtype=torch.float64)
        _close(cpu_gemm.mm_t(a.float(), w.float()), a @ w.t(), f"mm_t at {rows} rows")
        _close(cpu_gemm.mm(gy.float(), w.float()), gy @ w, f"mm at {rows} rows")
        counts.append(len(measured))
    want = [2, 2, 2, 4] if ONEDNN else [0, 0, 0, 0]
    assert counts == want, f"measurements after 33, 47, 64, 65 rows: {counts}"
    keys = {k.split("|", 2)[2] for k in _file_keys(tmp_path)}
    assert keys == ({f"cpu_gemm|{kind}|torch.float32|(rows<={r}, {k})x(53, 37)"
                     for r in (64, 128) for kind, k in (("mm", 53), ("mm_t", 37))}
                    if ONEDNN else set()), keys
