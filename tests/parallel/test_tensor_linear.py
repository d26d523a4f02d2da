"""Column/row-parallel linears and the overlap engines on 2 and 4 gloo ranks, in float64,
against dense ``nn.Linear``s built from the same weights (outputs, input and weight grads)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distllm import ParallelDims
from distllm.comm import autotune
from distllm.comm.overlap import CommContext, chunk_bounds, pipeline_bounds, run_engine
from distllm.nn.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_sequence,
    scatter_sequence,
)
from distllm.testing import run_distributed

TOL = 1e-10  # float64: sums over K <= 64 terms in a different order, ~1e-15 each
DT = torch.float64
MODES = [("none", 4), ("chunked", 1), ("chunked", 3), ("chunked", 4), ("chunked", 64),
         ("auto", 4)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _pair_case(dims, errs, d1, d2, x, act, sp, mode, chunks, tag):
    """fc2(act(fc1(x))) parallel vs dense: output, dX, and every weight/bias grad."""
    tp, r = dims.tp, dims.tp_rank
    approx = {None: None, "gelu": "none", "gelu_tanh": "tanh"}[act]
    for m in (d1, d2):
        m.zero_grad()
    xd = x.detach().clone().requires_grad_()
    h = d1(xd)
    ref = d2(h if approx is None else F.gelu(h, approximate=approx))
    (ref * torch.linspace(-1, 1, ref.shape[-1], dtype=DT)).sum().backward()
    c = ColumnParallelLinear.from_dense(d1, dims, activation=act, sequence_parallel=sp,
                                        overlap=mode, chunks=chunks)
    rw = RowParallelLinear.from_dense(d2, dims, sequence_parallel=sp, overlap=mode, chunks=chunks)
    xp = x.detach().clone().requires_grad_()
    y = rw(c(scatter_sequence(xp, dims) if sp else xp))
    y = gather_sequence(y, dims) if sp else y
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=DT)).sum().backward()
    errs[f"{tag} out"] = _err(y, ref)
    errs[f"{tag} dx"] = _err(xp.grad, xd.grad)
    errs[f"{tag} col.w"] = _err(c.weight.grad, d1.weight.grad.chunk(tp, 0)[r])
    errs[f"{tag} col.b"] = _err(c.bias.grad, d1.bias.grad.chunk(tp, 0)[r])
    errs[f"{tag} row.w"] = _err(rw.weight.grad, d2.weight.grad.chunk(tp, 1)[r])
    errs[f"{tag} row.b"] = _err(rw.bias.grad, d2.bias.grad)
    assert c.weight.tensor_model_parallel and rw.weight.tensor_model_parallel
    assert not getattr(rw.bias, "tensor_model_parallel", False)
    fwd = rw.overlap_stats.forward
    assert fwd.calls == 1
    if mode == "none":
        assert fwd.mode == "none" and fwd.overlapped == 0 and fwd.reason == "overlap='none'"
    if mode == "chunked":
        assert fwd.mode == "chunked" and fwd.overlapped == 1
        assert c.overlap_stats.backward.mode == "chunked"
    return rw.bias.grad.clone()


def _linears(tp: int):
    dims = ParallelDims(tp=tp)
    torch.manual_seed(0)
    errs: dict[str, float] = {}
    k, f = 12, 8 * tp  # f divisible by tp
    d1 = nn.Linear(k, f, dtype=DT)
    d2 = nn.Linear(f, k, dtype=DT)
    x = torch.randn(3, 7, k, dtype=DT)  # 21 rows: no chunk count above divides it evenly
    for mode, chunks in MODES:
        for act in (None, "gelu", "gelu_tanh"):
            _pair_case(dims, errs, d1, d2, x, act, False, mode, chunks, f"{mode}{chunks}/{act}")
    xs = torch.randn(2, 5 * tp, k, dtype=DT)  # sequence shard of 5 rows: 4 chunks do not divide
    bias_grads = []
    for mode, chunks in MODES:
        bias_grads.append(_pair_case(dims, errs, d1, d2, xs, "gelu", True, mode, chunks,
                                     f"sp {mode}{chunks}"))
    # a 2-D and a non-contiguous input, gather_output, input_is_parallel=False
    xt = torch.randn(k, 9, dtype=DT).t()  # (9, k), non-contiguous
    c = ColumnParallelLinear.from_dense(d1, dims, gather_output=True, overlap="chunked",
                                        chunks=2)
    rw = RowParallelLinear.from_dense(d2, dims, input_is_parallel=False, overlap="chunked",
                                      chunks=5)
    xp = xt.detach().clone().requires_grad_()
    y = rw(c(xp))
    xd = xt.detach().clone().requires_grad_()
    ref = d2(d1(xd))
    y.sum().backward()
    ref.sum().backward()
    errs["gathered 2d out"] = _err(y, ref)
    errs["gathered 2d dx"] = _err(xp.grad, xd.grad)
    return errs, [b.tolist() for b in bias_grads]


def _engines(tp: int):
    """Each engine, every chunk count incl. more chunks than rows, against the sequential one."""
    dims = ParallelDims(tp=tp)
    comm = CommContext(dims.tp_group)
    torch.manual_seed(1 + dims.rank)  # different data per rank: the collective matters
    w = torch.randn(6, 5, dtype=DT)
    mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
    errs = {}
    for kind, shape in (("all_reduce", (7, 5)), ("all_gather", (2, 3, 5)),
                        ("reduce_scatter", (2, 3 * tp, 5)), ("all_reduce", (1, 5)),
                        ("all_reduce", (769, 5)), ("all_gather", (1, 123, 5)),
                        ("reduce_scatter", (1, 123 * tp, 5))):
        a = torch.randn(*shape, dtype=DT)
        ref, _ = run_engine(kind, a, mm, 6, comm, 0)
        ref = ref[1] if kind == "all_gather" else ref
        for chunks in (1, 2, 3, 4, 9):
            out, extra = run_engine(kind, a, mm, 6, comm, chunks, then=lambda: 42)
            out = out[1] if kind == "all_gather" else out
            assert extra == 42
            errs[f"{kind}{shape} c={chunks}"] = _err(out, ref)
    # the all-reduce engine equals a dense sum over ranks
    a = torch.randn(7, 5, dtype=DT)
    got, _ = run_engine("all_reduce", a, mm, 6, comm, 3)
    full = a @ w.t()
    torch.distributed.all_reduce(full, group=dims.tp_group)
    errs["all_reduce vs sum"] = _err(got, full)
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_linears_parity_every_mode(tp):
    out = run_distributed(_linears, tp, tp, timeout=240)
    for rank, (errs, _) in enumerate(out):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"
    # the replicated row bias has the same grad on every tp rank, also under sp
    for rank in range(1, tp):
        assert out[rank][1] == out[0][1]


@pytest.mark.parametrize("tp", [2, 4])
def test_engines_match_sequential(tp):
    for rank, errs in enumerate(run_distributed(_engines, tp, tp, timeout=120)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_chunk_bounds():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(5, 1) == [(0, 5)]
    # the engines' pieces: first and last half-size, every row once, none empty
    assert [e - s for s, e in pipeline_bounds(2048, 4)] == [341, 683, 683, 341]
    for n in (1, 2, 3, 5, 7, 21, 123, 769):
        for c in (1, 2, 3, 4, 8, 64):
            b = pipeline_bounds(n, c)
            assert b[0][0] == 0 and b[-1][1] == n and len(b) == min(n, c)
            assert all(e > s for s, e in b)
            assert all(x[1] == y[0] for x, y in zip(b[:-1], b[1:], strict=True))


def _forced(times: dict[str, float]):
    """A stand-in for autotune's measurement returning fixed best-of times (ms)."""
    return lambda run, comm, rows, cuda, reps, extra: (list(times), list(times.values()))


def _auto_and_errors():
    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    autotune.clear_cache()
    records: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, rec):
            records.append(rec.getMessage())

    logging.getLogger("distllm").addHandler(_Catch())
    real, measured = autotune._measure, []

    def counting(*args):
        measured.append(args[2])
        return real(*args)

    autotune._measure = counting
    rw = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
    x = torch.randn(2, 6, 4, dtype=DT)
    for _ in range(3):
        rw(x)
    st = rw.overlap_stats.forward
    assert st.calls == 3 and st.comm_ms_est >= 0.0 and st.reason
    # the choice is the same on every rank (timings are reduced with MAX)
    choice = torch.tensor([float(st.chunks)])
    torch.distributed.all_reduce(choice, op=torch.distributed.ReduceOp.MAX)
    assert choice.item() == st.chunks
    # the log line, with the outcome forced each way (a real measurement may go either way)
    outcomes = {}
    for tag, times in (("slower", {"compute": 1.0, "sequential": 10.0, "2": 11.0, "4": 12.0}),
                       ("faster", {"compute": 1.0, "sequential": 10.0, "2": 6.0, "4": 8.0})):
        autotune.clear_cache()
        records.clear()
        autotune._measure = _forced(times)
        layer = RowParallelLinear(8, 4, dims, overlap="auto", dtype=DT)
        for _ in range(3):
            layer(x)
        f = layer.overlap_stats.forward
        outcomes[tag] = (f.mode, f.chunks, len([m for m in records if "falls back" in m]))
    autotune._measure = real
    msgs = []
    for bad in (
        lambda: ColumnParallelLinear(8, 7, dims),
        lambda: RowParallelLinear(7, 8, dims),
        lambda: RowParallelLinear(8, 8, dims, overlap="always"),
        lambda: RowParallelLinear(8, 8, dims, chunks=0),
        lambda: ColumnParallelLinear(8, 8, dims, activation="relu"),
        lambda: scatter_sequence(torch.zeros(1, 7, 8), dims),
        lambda: RowParallelLinear(8, 8, dims, sequence_parallel=True)(torch.zeros(1, 7, 4)),
    ):
        with pytest.raises(ValueError) as ei:
            bad()
        msgs.append(str(ei.value))
    return len(measured), outcomes, msgs


def test_auto_consistent_logs_once_and_bad_input():
    for n_measured, outcomes, msgs in run_distributed(_auto_and_errors, 2, timeout=120):
        assert n_measured == 1, f"three calls of one shape measured {n_measured} times"
        # chunked slower than sequential: no overlap, said once over three calls
        assert outcomes["slower"] == ("none", 0, 1), outcomes
        # chunked faster: the fastest chunk count, nothing logged
        assert outcomes["faster"] == ("chunked", 2, 0), outcomes
        assert "out_features" in msgs[0] and "in_features" in msgs[1]
        assert "overlap" in msgs[2] and "chunks" in msgs[3] and "activation" in msgs[4]
        assert "seq_len" in msgs[5] and "seq_len" in msgs[6]


def _cuda_engines():
    """The CUDA path (communication stream + events) on a 1-rank NCCL group."""
    group = torch.distributed.new_group(ranks=[0], backend="nccl")
    comm = CommContext(group)
    torch.manual_seed(0)
    w = torch.randn(96, 80, device="cuda", dtype=DT)
    mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
    errs = {}
    for kind, shape in (("all_reduce", (123, 80)), ("all_gather", (2, 37, 80)),
                        ("reduce_scatter", (2, 37, 80))):
        a = torch.randn(*shape, device="cuda", dtype=DT)
        ref = F.linear(a, w)
        for chunks in (0, 1, 3, 4):
            out, extra = run_engine(kind, a, mm, 96, comm, chunks, then=a.sum)
            out = out[1] if kind == "all_gather" else out
            torch.cuda.synchronize()
            errs[f"{kind} c={chunks}"] = _err(out.cpu(), ref.cpu())
            errs[f"{kind} c={chunks} then"] = _err(extra.cpu(), a.sum().cpu())
    return errs


@pytest.mark.gpu
def test_engines_on_cuda_streams():
    errs = run_distributed(_cuda_engines, 1, timeout=120)[0]
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, bad
