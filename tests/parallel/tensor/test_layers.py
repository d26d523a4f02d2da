"""The column- and row-parallel GEMMs with their communication, through the
``ColumnParallelLinear`` / ``RowParallelLinear`` modules, on 2 and 4 gloo ranks in float64
against dense ``nn.Linear``s built from the same weights (output, input grad, every weight
and bias grad), for every overlap mode, activation, with and without sequence parallelism;
the collective each direction records as having run; and the errors that name the knob
(a wrong input width among them, raised before any collective).
One spawn per world size, each scenario its own test."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distllm.nn.mlp import ParallelMLP
from distllm.nn.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_sequence,
    scatter_sequence,
)
from distllm.parallel.tensor import column_parallel_matmul, row_parallel_matmul
from distllm.parallel.tensor.layers import OverlapPlan
from tests._spawn import SpawnCache, case_of, run_cases

TOL = 1e-10  # float64: sums over K <= 64 terms in a different order, ~1e-15 each
DT = torch.float64
MODES = [("none", 4), ("chunked", 1), ("chunked", 3), ("chunked", 4), ("chunked", 64),
         ("auto", 4)]
ACTS = (None, "gelu", "gelu_tanh")
PLAIN = {f"{m}{c}-{a}": (m, c, a) for m, c in MODES for a in ACTS}
SP = {f"sp-{m}{c}": (m, c) for m, c in MODES}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _ran(layer) -> tuple[str, str]:
    st = layer.overlap_stats
    return st.forward.collective, st.backward.collective


def _pair_case(dims, d1, d2, x, act, sp, mode, chunks) -> dict:
    """fc2(act(fc1(x))) parallel vs dense: output, dX, and every weight/bias grad; what the
    layers' records say ran."""
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
    errs = {"out": _err(y, ref), "dx": _err(xp.grad, xd.grad),
            "col.w": _err(c.weight.grad, d1.weight.grad.chunk(tp, 0)[r]),
            "col.b": _err(c.bias.grad, d1.bias.grad.chunk(tp, 0)[r]),
            "row.w": _err(rw.weight.grad, d2.weight.grad.chunk(tp, 1)[r]),
            "row.b": _err(rw.bias.grad, d2.bias.grad)}
    fwd = rw.overlap_stats.forward
    return {"errs": errs, "ran": (_ran(c), _ran(rw)), "row_bias_grad": rw.bias.grad.tolist(),
            "marks": (c.weight.tensor_model_parallel, rw.weight.tensor_model_parallel,
                      getattr(rw.bias, "tensor_model_parallel", False)),
            "row_fwd": (fwd.calls, fwd.mode, fwd.overlapped, fwd.reason),
            "col_bwd_mode": c.overlap_stats.backward.mode}


def _gathered_2d(dims, d1, d2) -> dict:
    """A 2-D non-contiguous input, ``gather_output``, ``input_is_parallel=False``."""
    xt = torch.randn(d1.in_features, 9, dtype=DT).t()  # (9, k), non-contiguous
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
    return {"errs": {"out": _err(y, ref), "dx": _err(xp.grad, xd.grad)},
            "ran": (_ran(c), _ran(rw))}


def _no_input_grad(dims, d1, mode: str) -> tuple[str, str]:
    """A column layer whose input needs no gradient: no collective in its backward."""
    c = ColumnParallelLinear.from_dense(d1, dims, overlap=mode)
    c(torch.randn(3, d1.in_features, dtype=DT)).sum().backward()
    return _ran(c)


def layers_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    tp = dims.tp
    torch.manual_seed(0)
    k, f = 12, 8 * tp  # f divisible by tp
    d1, d2 = nn.Linear(k, f, dtype=DT), nn.Linear(f, k, dtype=DT)
    x = torch.randn(3, 7, k, dtype=DT)  # 21 rows: no chunk count above divides it evenly
    xs = torch.randn(2, 5 * tp, k, dtype=DT)  # sequence shard of 5 rows: 4 chunks do not divide
    cases = {name: (lambda m=m, c=c, a=a: _pair_case(dims, d1, d2, x, a, False, m, c))
             for name, (m, c, a) in PLAIN.items()}
    cases.update({name: (lambda m=m, c=c: _pair_case(dims, d1, d2, xs, "gelu", True, m, c))
                  for name, (m, c) in SP.items()})
    cases["gathered-2d"] = lambda: _gathered_2d(dims, d1, d2)
    cases["no-input-grad-chunked"] = lambda: _no_input_grad(dims, d1, "chunked")
    cases["no-input-grad-none"] = lambda: _no_input_grad(dims, d1, "none")
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=240)


def _check_parity(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("case", list(PLAIN))
@pytest.mark.parametrize("tp", [2, 4])
def test_linears_parity(spawned, tp, case):
    results = case_of(spawned(layers_main, tp), case)
    _check_parity(results)
    mode = PLAIN[case][0]
    for res in results:
        assert res["marks"] == (True, True, False)  # sharded weights marked, row bias not
        # the column layer runs no collective forward and all-reduces dX backward (engine or
        # f operator); the row layer all-reduces Y forward and runs none backward
        assert res["ran"] == (("none", "all_reduce"), ("all_reduce", "none"))
        calls, ran_mode, overlapped, reason = res["row_fwd"]
        assert calls == 1
        if mode == "none":
            assert (ran_mode, overlapped, reason) == ("none", 0, "overlap='none'")
        if mode == "chunked":
            assert (ran_mode, overlapped) == ("chunked", 1)
            assert res["col_bwd_mode"] == "chunked"


@pytest.mark.parametrize("case", list(SP))
@pytest.mark.parametrize("tp", [2, 4])
def test_linears_parity_sequence_parallel(spawned, tp, case):
    results = case_of(spawned(layers_main, tp), case)
    _check_parity(results)
    for res in results:
        assert res["ran"] == (("all_gather", "reduce_scatter"), ("reduce_scatter", "all_gather"))
    # the replicated row bias has the same (all-reduced) grad on every tp rank
    assert all(res["row_bias_grad"] == results[0]["row_bias_grad"] for res in results)


@pytest.mark.parametrize("tp", [2, 4])
def test_gathered_output_and_split_input(spawned, tp):
    results = case_of(spawned(layers_main, tp), "gathered-2d")
    _check_parity(results)
    assert results[0]["ran"] == (("none", "all_reduce"), ("all_reduce", "none"))


@pytest.mark.parametrize("mode", ["chunked", "none"])
def test_no_collective_recorded_without_input_grad(spawned, mode):
    for ran in case_of(spawned(layers_main, 2), f"no-input-grad-{mode}"):
        assert tuple(ran) == ("none", "none")


DIMS = types.SimpleNamespace(tp=2, tp_rank=0, tp_group=None)  # no collective runs below
BAD = {  # name: (what raises, the knob its message must name)
    "out_features": (lambda: ColumnParallelLinear(8, 7, DIMS), "out_features"),
    "in_features": (lambda: RowParallelLinear(7, 8, DIMS), "in_features"),
    "overlap": (lambda: RowParallelLinear(8, 8, DIMS, overlap="always"), "overlap"),
    "chunks": (lambda: RowParallelLinear(8, 8, DIMS, chunks=0), "chunks"),
    "chunks_bool": (lambda: RowParallelLinear(8, 8, DIMS, chunks=True), "chunks=True"),
    "activation": (lambda: ColumnParallelLinear(8, 8, DIMS, activation="relu"), "activation"),
    "scatter_sequence": (lambda: scatter_sequence(torch.zeros(1, 7, 8), DIMS), "seq_len"),
    "row_sequence": (lambda: RowParallelLinear(8, 8, DIMS, sequence_parallel=True)(
        torch.zeros(1, 7, 4)), "seq_len"),
    # the autograd entry itself (a reshape error deep in the engine before)
    "row_matmul_sequence": (lambda: row_parallel_matmul(
        torch.zeros(1, 7, 4), torch.zeros(8, 4), None, types.SimpleNamespace(tp=2), True),
        "seq_len a multiple of 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_knob(case):
    make, knob = BAD[case]
    with pytest.raises(ValueError, match=knob):
        make()


def test_auto_overlap_choices_with_and_without_work_after_are_apart(monkeypatch):
    """Work after the collective (a backward's weight-gradient GEMM, ``then``) makes one
    piece a candidate of ``overlap="auto"``: a choice made with it is not reused for a call
    without it (the memo of the exact call and the tuner's key both tell them apart)."""
    from distllm.parallel.tensor import overlap_tuner

    asked = []

    def choose(key, run, comm, rows, device, what, **kw):
        asked.append((key, kw["one_piece"]))
        return overlap_tuner.Choice(0, 0.0, 0.0, 0.0, "stand-in")

    monkeypatch.setattr(overlap_tuner, "choose", choose)
    plan = OverlapPlan(DIMS, "auto", 4, "t")
    plan._comm = types.SimpleNamespace()  # (no group: the stand-in tuner communicates nothing)
    a = torch.zeros(8, 4)
    for then in (None, lambda: None, None, lambda: None):
        plan._schedule("backward", "all_reduce", a, None, 4, then)
    assert [one for _, one in asked] == [False, True], asked  # then each one's memo
    assert asked[0][0] != asked[1][0]


WIDTH = {  # name: (call with an input of the wrong width, the message), at tp=2
    "row, input_is_parallel": (
        lambda: RowParallelLinear(8, 10, DIMS)(torch.zeros(3, 8)),
        r"RowParallelLinear: input of shape \(3, 8\) has 8 features, expected 4 \(in_features=8 "
        r"/ tp=2 with input_is_parallel=True; for the full 8-feature input use "
        r"input_is_parallel=False\)"),
    "row, full input": (
        lambda: RowParallelLinear(8, 10, DIMS, input_is_parallel=False)(torch.zeros(3, 4)),
        r"has 4 features, expected 8 \(in_features=8 with input_is_parallel=False; for an input "
        r"already split over tp \(4 features\) use input_is_parallel=True\)"),
    "column": (
        lambda: ColumnParallelLinear(8, 10, DIMS, overlap="chunked")(torch.zeros(2, 3, 16)),
        r"ColumnParallelLinear: input of shape \(2, 3, 16\) has 16 features, expected 8 "
        r"\(in_features=8: every rank takes the whole input\)"),
    "column, fused gelu": (
        lambda: ColumnParallelLinear(8, 10, DIMS, activation="gelu")(torch.zeros(3, 4)),
        r"has 4 features, expected 8 \(in_features=8"),
    "mlp": (
        lambda: ParallelMLP(8, 16, DIMS)(torch.zeros(3, 4)),
        r"ParallelMLP: input of shape \(3, 4\) has 4 features, expected 8 \(hidden=8"),
    "row_parallel_matmul": (
        lambda: _matmul(RowParallelLinear(8, 10, DIMS), row_parallel_matmul, 8),
        r"row_parallel_matmul: input of shape \(3, 8\) does not fit this rank's weight \(10, 4\): "
        r"its last dim must be 4"),
    "column_parallel_matmul": (
        lambda: _matmul(ColumnParallelLinear(8, 10, DIMS), column_parallel_matmul, 4),
        r"column_parallel_matmul: input of shape \(3, 4\) does not fit this rank's weight "
        r"\(5, 8\): its last dim must be 8"),
}


def _matmul(layer, fn, width: int):
    return fn(torch.zeros(3, width), layer.weight, layer.bias, layer.plan, False)


@pytest.mark.parametrize("case", list(WIDTH))
def test_wrong_input_width_names_in_features_before_any_collective(case):
    make, match = WIDTH[case]
    with pytest.raises(ValueError, match=match):
        make()
