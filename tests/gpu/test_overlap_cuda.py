"""The overlap engines' CUDA path (collectives on a communication stream, ordered by events)
in a 1-rank NCCL world: all-reduce, all-gather and reduce-scatter engines, sequential and
chunked, float64 (exact up to summation order) and bfloat16, against F.linear; and the
CUDA_DEVICE_MAX_CONNECTIONS advice on the real device (warned once on compute capability
>= 9.0 unless the variable is 1).

Needing more than one GPU, and therefore not here: the engines with NCCL peers (data
actually moving between ranks while the next chunk computes), the TP layers at tp >= 2 on
CUDA, and overlap measured on NVLink. The same schedules run on 2 and 4 gloo ranks in
tests/parallel/tensor/test_overlap.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.gpu._nccl import run_nccl

pytestmark = pytest.mark.gpu

TOL = {
    torch.float64: 1e-12,  # one GEMM per row chunk: the same dot products as F.linear
    torch.bfloat16: 2e-2,  # bf16 output of an fp32-accumulated GEMM, chunked or not (2^-8)
}


def _engines(dtype_name: str) -> dict[str, float]:
    import torch.distributed as dist

    from distllm.parallel.tensor.overlap import CommContext, run_engine

    dtype = getattr(torch, dtype_name)
    comm = CommContext(dist.group.WORLD)
    assert comm.backend == "nccl"
    torch.manual_seed(0)
    w = torch.randn(96, 80, device="cuda", dtype=dtype) * 80**-0.5
    mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
    errs = {}
    for kind, shape in (
        ("all_reduce", (123, 80)),
        ("all_gather", (2, 37, 80)),
        ("reduce_scatter", (2, 37, 80)),
    ):
        a = torch.randn(*shape, device="cuda", dtype=dtype)
        ref = F.linear(a.double(), w.double())
        for chunks in (0, 2, 3):
            out, extra = run_engine(kind, a, mm, 96, comm, chunks, then=lambda a=a: a.sum())
            out = out[1] if kind == "all_gather" else out
            torch.cuda.synchronize()
            assert out.is_cuda and out.dtype == dtype
            scale = ref.abs().max().item()
            errs[f"{kind} chunks={chunks}"] = (out.double() - ref).abs().max().item() / scale
            errs[f"{kind} chunks={chunks} then"] = abs(float(extra) - float(a.double().sum())) / (
                a.double().abs().sum().item()
            )
    return errs


@pytest.mark.parametrize("dtype", list(TOL))
def test_engines_on_cuda_streams(dtype):
    errs = run_nccl(_engines, str(dtype).removeprefix("torch."))
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad


def _advice_from_a_chunked_engine() -> tuple[tuple[int, int], list[str]]:
    import torch.distributed as dist

    from distllm.parallel.tensor.overlap import CommContext, run_engine

    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("distllm").addHandler(_Keep())
    comm = CommContext(dist.group.WORLD)
    w = torch.randn(16, 8, device="cuda")
    for _ in range(3):  # three overlapped calls: one warning at most
        run_engine(
            "all_reduce",
            torch.randn(12, 8, device="cuda"),
            lambda a, o: torch.mm(a, w.t(), out=o),
            16,
            comm,
            3,
        )
    torch.cuda.synchronize()
    return torch.cuda.get_device_capability(), [m for m in seen if "MAX_CONNECTIONS" in m]


@pytest.mark.parametrize("value", ["1", "8"])
def test_max_connections_advice_on_this_gpu(value):
    cap, msgs = run_nccl(_advice_from_a_chunked_engine, env={"CUDA_DEVICE_MAX_CONNECTIONS": value})
    if tuple(cap) >= (9, 0) and value != "1":
        assert len(msgs) == 1 and "CUDA_DEVICE_MAX_CONNECTIONS=1" in msgs[0], msgs
    else:
        assert msgs == [], (cap, msgs)
