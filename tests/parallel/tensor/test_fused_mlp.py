"""The fused column-parallel GEMM + bias + GeLU and the MLP whose backward is fused across
its two GEMMs (``distllm.parallel.tensor.fused_mlp``, through ``ParallelMLP`` and
``ColumnParallelLinear(activation=...)``), on 1, 2 and 4 gloo ranks, against a dense float64
``DenseMLP`` built from the same weights: output, input gradient and every weight and bias
gradient, for every backend that runs on CPU (cpu, the unfused reference, and Triton through
its interpreter in float32), with and without sequence parallelism, in every overlap mode.
Each case also checks, from the profiler, that the fused ops ran (and the unfused epilogue
did not), and what the layer's stats say ran."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distllm.nn import ColumnParallelLinear, ParallelMLP
from distllm.nn.mlp import DenseMLP
from distllm.nn.parallel_linear import gather_sequence, scatter_sequence
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64
TOL_F32 = 2e-5  # Triton (interpreter) in float32 against the float64 reference
MODES = (("none", 4), ("chunked", 3), ("auto", 4))
MLP_CASES = {f"mlp-{be}-{'sp' if sp else 'nosp'}-{m}{c}": (be, sp, m, c)
             for be in ("cpu", "reference", "triton") for sp in (False, True) for m, c in MODES}
COL_CASES = {f"col-{be}-{'sp' if sp else 'nosp'}-{m}{c}": (be, sp, m, c)
             for be in ("cpu", "reference") for sp in (False, True)
             for m, c in (("none", 4), ("chunked", 3))}
COL_CASES["col-triton-sp-chunked3"] = ("triton", True, "chunked", 3)


def _mlp_cases_at(tp: int) -> list[str]:
    """The MLP cases run on ``tp`` ranks. At 4 ranks Triton's ``auto`` cases are left to the
    2-rank run: each rank's shard (and so the kernel's shape) is the same at 2 and 4 ranks, the
    4-rank collectives are covered by the other backends' ``auto`` cases, and under the
    interpreter the tuner's timed repetitions of those two cases took 42 of that run's 72 s."""
    return [n for n, (be, _, m, _) in MLP_CASES.items()
            if not (tp == 4 and be == "triton" and m == "auto")]


def _ops_run(fn) -> set[str]:
    """The ``distllm::`` ops that ran inside ``fn()`` (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("distllm::")}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _mlp_case(dims, backend, sp, mode, chunks, act) -> dict:
    tp, r = dims.tp, dims.tp_rank
    h, f = 12, 8 * tp
    torch.manual_seed(1)
    dense = DenseMLP(h, f, activation=act, dtype=torch.float64)
    dt = torch.float32 if backend == "triton" else torch.float64
    x = torch.randn(2, 5 * tp, h, dtype=torch.float64) if sp else torch.randn(3, 7, h,
                                                                             dtype=torch.float64)
    dense_c = DenseMLP(h, f, activation=act, dtype=dt)
    dense_c.load_state_dict(dense.state_dict())
    mlp = ParallelMLP.from_dense(dense_c, dims, sequence_parallel=sp, overlap=mode, chunks=chunks,
                                 backend=backend)
    xr = x.clone().requires_grad_()
    y_ref = dense(xr)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    xp = x.to(dt).requires_grad_()

    out = {}

    def step():
        y = mlp(scatter_sequence(xp, dims) if sp else xp)
        y = gather_sequence(y, dims) if sp else y
        y.backward(g.to(dt))
        out["y"] = y

    ops = _ops_run(step)
    sl = f // tp
    errs = {
        "y": _err(out["y"], y_ref),
        "dx": _err(xp.grad, xr.grad),
        "dw1": _err(mlp.fc1.weight.grad, dense.fc1.weight.grad[r * sl:(r + 1) * sl]),
        "db1": _err(mlp.fc1.bias.grad, dense.fc1.bias.grad[r * sl:(r + 1) * sl]),
        "dw2": _err(mlp.fc2.weight.grad, dense.fc2.weight.grad[:, r * sl:(r + 1) * sl]),
        "db2": _err(mlp.fc2.bias.grad, dense.fc2.bias.grad),
    }
    st = mlp.overlap_stats
    return {"errs": errs, "ops": sorted(ops), "kernel": st["fc1"].kernel,
            "fc2_kernel": st["fc2"].kernel,
            "ran": (st["fc1"].forward.collective, st["fc1"].backward.collective,
                    st["fc2"].forward.collective, st["fc2"].backward.collective)}


def _col_case(dims, backend, sp, mode, chunks) -> dict:
    tp, r = dims.tp, dims.tp_rank
    k, f = 12, 8 * tp
    torch.manual_seed(2)
    d1 = nn.Linear(k, f, dtype=torch.float64)
    dt = torch.float32 if backend == "triton" else torch.float64
    d1c = nn.Linear(k, f, dtype=dt)
    d1c.load_state_dict(d1.state_dict())
    col = ColumnParallelLinear.from_dense(d1c, dims, activation="gelu_tanh", sequence_parallel=sp,
                                          overlap=mode, chunks=chunks, backend=backend)
    x = torch.randn(2, 5 * tp, k, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    y_ref = F.gelu(d1(xr), approximate="tanh")
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    sl = f // tp
    xp = x.to(dt).requires_grad_()
    out = {}

    def step():
        y = col(scatter_sequence(xp, dims) if sp else xp)  # (b, s, f/tp)
        y.backward(g[..., r * sl:(r + 1) * sl].to(dt))
        out["y"] = y

    ops = _ops_run(step)
    # each rank's backward starts from its slice of g; the layer's collective sums them
    errs = {"y": _err(out["y"], y_ref[..., r * sl:(r + 1) * sl]), "dx": _err(xp.grad, xr.grad)}
    errs["dw"] = _err(col.weight.grad, d1.weight.grad[r * sl:(r + 1) * sl])
    errs["db"] = _err(col.bias.grad, d1.bias.grad[r * sl:(r + 1) * sl])
    st = col.overlap_stats
    return {"errs": errs, "ops": sorted(ops), "kernel": st.kernel,
            "ran": (st.forward.collective, st.backward.collective)}


def fused_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    cases = {}
    run = set(_mlp_cases_at(dims.tp))
    for i, (name, (be, sp, m, c)) in enumerate(MLP_CASES.items()):
        if name not in run:
            continue
        act = ("gelu", "gelu_tanh")[i % 2]
        cases[name] = lambda be=be, sp=sp, m=m, c=c, a=act: _mlp_case(dims, be, sp, m, c, a)
    for name, (be, sp, m, c) in COL_CASES.items():
        cases[name] = lambda be=be, sp=sp, m=m, c=c: _col_case(dims, be, sp, m, c)
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=300)


def _check_fused(results: list[dict], backend: str, mlp: bool) -> dict:
    """Every rank within tolerance of the float64 reference, through the fused ops (never the
    unfused epilogue), its stats naming ``backend``; returns rank 0's result."""
    tol = TOL_F32 if backend == "triton" else TOL
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v < tol}
        assert not bad, f"rank {rank}: {bad} (tolerance {tol})"
        ops = res["ops"]
        assert "distllm::linear_gelu_fwd" in ops, ops  # the forward went through the fused op
        assert "distllm::bias_gelu" not in ops and "distllm::bias_gelu_backward" not in ops, ops
        if mlp:  # the GeLU derivative went into fc2's input-gradient GEMM
            assert "distllm::gemm_dgelu" in ops, ops
        assert res["kernel"].startswith(f"{backend}:"), res["kernel"]
        assert ("unfused" in res["kernel"]) == (backend == "reference"), res["kernel"]
    return results[0]


@pytest.mark.parametrize(("tp", "case"), [(tp, c) for tp in (2, 4) for c in _mlp_cases_at(tp)])
def test_parallel_mlp_parity(spawned, tp, case):
    backend, sp, _, _ = MLP_CASES[case]
    res = _check_fused(case_of(spawned(fused_main, tp), case), backend, mlp=True)
    want = (("all_gather", "reduce_scatter", "reduce_scatter", "all_gather") if sp
            else ("none", "all_reduce", "all_reduce", "none"))
    assert res["ran"] == want, res["ran"]


@pytest.mark.parametrize("case", list(COL_CASES))
@pytest.mark.parametrize("tp", [2, 4])
def test_column_linear_gelu_parity(spawned, tp, case):
    backend, sp, _, _ = COL_CASES[case]
    res = _check_fused(case_of(spawned(fused_main, tp), case), backend, mlp=False)
    assert res["ran"] == (("all_gather", "reduce_scatter") if sp else ("none", "all_reduce"))


def single_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=1)
    cases = {f"tp1-{be}-{a}": (lambda be=be, a=a: _mlp_case(dims, be, False, "auto", 4, a))
             for be in ("cpu", "reference", "triton") for a in ("gelu", "gelu_tanh")}
    return run_cases(cases)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_parallel_mlp_tp1(spawned, backend, act):
    results = case_of(spawned(single_main, 1), f"tp1-{backend}-{act}")
    if backend == "reference":  # one device, unfused: autograd's own linear and GeLU nodes
        res = results[0]
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"{bad} (tolerance {TOL})"
        assert not [op for op in res["ops"] if op.startswith("distllm::")], res["ops"]
        assert res["kernel"].startswith("reference:") and "unfused" in res["kernel"]
    else:
        res = _check_fused(results, backend, mlp=True)
    assert res["ran"] == ("none", "none", "none", "none"), res["ran"]


def test_backend_knob_errors():
    with pytest.raises(ValueError, match="backend='bogus'"):
        ParallelMLP(8, 16, _Dims1(), backend="bogus")
    with pytest.raises(ValueError, match="backend='bogus'"):
        ColumnParallelLinear(8, 16, _Dims1(), activation="gelu", backend="bogus")


def test_explicit_backend_that_cannot_run_names_the_alternatives():
    mlp = ParallelMLP(8, 16, _Dims1(), backend="cuda")  # no CUDA tensors here
    with pytest.raises(ValueError, match=r"backend='cuda' cannot run here.*Available"):
        mlp(torch.randn(2, 3, 8))


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
def test_an_input_of_another_dtype_is_one_error_before_anything_is_timed(backend):
    """Not the backend choice's "every candidate raised", nor a GEMM's dtype error; under
    autocast the layer takes it."""
    mlp = ParallelMLP(8, 16, _Dims1(), backend=backend)
    col = ColumnParallelLinear(8, 16, _Dims1(), activation="gelu", backend=backend)
    for layer in (mlp, col):
        with pytest.raises(ValueError, match=r"^the input is torch.float64 and the layer's "
                                             r"weight torch.float32, its bias torch.float32: "
                                             r"cast the input \(x.to\(torch.float32\)\)"):
            layer(torch.randn(2, 3, 8, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert col(torch.randn(2, 3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


class _Dims1:
    """tp=1 without a process group (nothing here communicates)."""

    tp, tp_rank, tp_group = 1, 0, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bias_on_one_device_rounds_once_as_f_linear_does(dtype):
    """Where the bias is whole on this rank (tp=1, and a column-parallel shard), it goes into
    the GEMM: the bf16/fp16 output is ``F.linear``'s, bit for bit, not the product rounded and
    then the sum rounded again (which left about 15% of the outputs one ulp off)."""
    torch.manual_seed(0)
    x = torch.randn(4, 33, 64, dtype=dtype)
    col = ColumnParallelLinear(64, 96, _Dims1(), dtype=dtype, backend="cpu")
    mlp = ParallelMLP(64, 96, _Dims1(), dtype=dtype, backend="cpu")
    with torch.no_grad():
        for b in (col.bias, mlp.fc1.bias, mlp.fc2.bias):  # as large as the products
            b.copy_(torch.randn_like(b) * 4)
        assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
        fc1 = ColumnParallelLinear(64, 96, _Dims1(), activation="gelu", dtype=dtype,
                                   backend="cpu")
        fc1.load_state_dict(mlp.fc1.state_dict())
        y = fc1(x)  # the same fused kernel as the MLP's first GEMM
        assert torch.equal(mlp(x), F.linear(y, mlp.fc2.weight, mlp.fc2.bias))


def test_auto_resolves_once_per_bucket_of_rows(monkeypatch):
    """backend="auto" on a fused layer at 33, 47 and 64 rows (varying sequence lengths)
    resolves once, at 65 rows once more: the layer's memo, like the choice it keeps, is per
    bucket of rows rounded up to a power of two. Outputs against the float64 layer (fp32
    accumulation over K = 37: a few 1e-7 of the largest magnitude)."""
    import importlib

    from distllm.ops import backend_choice

    lg = importlib.import_module("distllm.ops.linear_gelu")  # the package's is the function
    asked, real = [], lg._choose_end_to_end

    def choose(x, w, b, approximate, needs_grad):
        asked.append(x.shape[0])
        return real(x, w, b, approximate, needs_grad)

    monkeypatch.setattr(lg, "_choose_end_to_end", choose)
    monkeypatch.delenv("DISTLLM_AUTOTUNE_CACHE", raising=False)
    backend_choice.clear()
    torch.manual_seed(0)
    col = ColumnParallelLinear(37, 53, _Dims1(), activation="gelu", backend="auto")
    ref = nn.Linear(37, 53, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(col.weight)
        ref.bias.copy_(col.bias)
    try:
        for lead in ((3, 11), (47,), (2, 32), (5, 13)):
            x = torch.randn(*lead, 37, dtype=torch.float64)
            y = col(x.float())
            want = F.gelu(ref(x)).detach()
            err = ((y.double() - want).abs().max() / want.abs().max()).item()
            assert err < TOL_F32, f"rows {lead}: relative error {err:.3g}"
    finally:
        backend_choice.clear()
    assert asked == [33, 65], f"the choice was resolved at rows {asked}"
