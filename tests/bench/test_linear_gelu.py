"""The fused GEMM + bias + GeLU benchmark: it offers only the fused backends of the device it
runs on (no ``fused-cpu`` on CUDA), and a tiny CPU case runs through the runner with a row
per variant, timed or unavailable with its reason."""

from __future__ import annotations

import torch
from distllm.bench import linear_gelu as lg_bench
from distllm.bench.harness import BenchConfig, run

from distllm.ops import linear_gelu_backends as impl


def _ok_everywhere(monkeypatch):
    monkeypatch.setattr(
        impl,
        "availability",
        lambda: {b: "ok: test" for b in ("cuda", "triton", "cpu", "reference")},
    )
    real = impl.why_not

    def why_not(backend, x, w, approximate):
        if backend == "cuda":  # as on a GPU: cuBLASLt's GeLU is the tanh form
            return None if approximate == "tanh" else "tanh only"
        return None if backend == "triton" else real(backend, x, w, approximate)

    monkeypatch.setattr(impl, "why_not", why_not)


def test_linear_gelu_bench_offers_only_the_devices_backends(monkeypatch):
    _ok_everywhere(monkeypatch)
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    on_cuda = lg_bench._variants("fwd", x, w, b, "tanh", "cuda")
    assert "fused-cpu" not in on_cuda and "cpu-rowblocked" not in on_cuda
    assert {"fused-cuda", "fused-triton", "gemm-nobias", "peer-addmm-activation"} <= set(on_cuda)
    assert on_cuda["fused-cuda"][0] is not None and on_cuda["fused-triton"][0] is not None
    erf = lg_bench._variants("fwd", x, w, b, "none", "cuda")
    assert erf["fused-cuda"] == (None, "tanh only")  # a row with its reason, not a failure
    on_cpu = lg_bench._variants("fwd_train", x, w, b, "none", "cpu")
    assert not {"fused-cuda", "fused-triton", "gemm-nobias"} & set(on_cpu)
    assert on_cpu["fused-cpu"][0] is not None


def test_linear_gelu_runs_every_phase_on_a_tiny_shape():
    cfg = BenchConfig(quick=True, shapes="7,16,24", reps=2,
                      extra={"linear_gelu_timer": "cpu"})
    threads = torch.get_num_threads()
    rows = run(lg_bench, cfg)
    assert torch.get_num_threads() == threads  # the one-thread timer restores the setting
    assert list(dict.fromkeys(r["case"] for r in rows)) == [
        "fwd 7x16x24 float32", "fwd_train 7x16x24 float32", "bwd 7x16x24 float32",
        "fwd+bwd 7x16x24 float32"]
    for r in rows:
        assert r["extra"]["timer"] == "cpu-time, 1 thread", r
        if r["status"] == "ok":
            assert r["reps"] == 2 and r["ms"] >= 0 and r["shape"] == "7x16x24", r
        else:
            assert r["status"] == "unavailable" and r["reason"], r
    fwd = {r["variant"]: r for r in rows if r["case"].startswith("fwd ")}
    assert {"unfused", "fused-auto", "fused-cpu", "gemm-only"} <= {
        v for v, r in fwd.items() if r["status"] == "ok"}, fwd
    assert fwd["unfused"]["speedup_vs_unfused"] == 1.0
