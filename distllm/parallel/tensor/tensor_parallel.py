"""Tensor-parallel building blocks: sharding helpers, the overlap plan of a layer, and the
autograd Functions of the column- and row-parallel GEMMs that drive the overlap engines of
:mod:`distllm.comm.overlap`.

Collectives (``tp`` ranks; ``sp`` = sequence parallelism):

====================  ==========================================  ================================
Function              forward                                     backward
====================  ==========================================  ================================
column, no sp         none                                        all-reduce of dX, chunked and
                                                                  overlapped with the dW GEMM
column, sp            all-gather of X along seq, chunk by chunk   reduce-scatter of dX along seq,
                      overlapped with the GEMM                    overlapped with the dW GEMM
row, no sp            all-reduce of Y, chunked along rows and     none
                      overlapped with the GEMM
row, sp               reduce-scatter of Y along seq, chunked and  all-gather of dY along seq,
                      overlapped with the GEMM                    overlapped with the dX GEMM
====================  ==========================================  ================================
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from distllm.comm import autotune
from distllm.comm.overlap import CommContext, OverlapStats, run_engine

__all__ = ["divide", "check_divisible", "shard", "mark_tensor_parallel", "mark_sequence_parallel",
           "init_full_weight", "OverlapPlan", "column_parallel_matmul", "row_parallel_matmul",
           "OVERLAP_MODES"]

OVERLAP_MODES = ("auto", "chunked", "none")


def check_divisible(n: int, tp: int, what: str, knob: str) -> None:
    """Raise a ValueError naming ``knob`` unless ``tp`` divides ``n``."""
    if n % tp:
        ok = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
        raise ValueError(f"{what}={n} is not divisible by tp={tp}: choose {knob} divisible by "
                         f"{tp}, or tp in {ok}")


def divide(n: int, tp: int, what: str = "size", knob: str = "the size") -> int:
    check_divisible(n, tp, what, knob)
    return n // tp


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of ``t`` along ``dim`` (a copy)."""
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).clone().contiguous()


def mark_tensor_parallel(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    """Megatron's attributes of a sharded parameter (``tensor_model_parallel`` and
    ``partition_dim``): grad-norm code counts it on every rank, replicated ones once."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    return p


def mark_sequence_parallel(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A replicated parameter applied to a sequence shard. Its gradient is already
    all-reduced over tp inside the module (nothing for the trainer to do)."""
    p.sequence_parallel = True
    return p


def init_full_weight(shape: tuple[int, ...], fan_in: int, init_method: Callable | None,
                     dtype, device) -> torch.Tensor:
    """The full (unsharded) tensor, initialised identically on every rank given the same seed
    (``init_method(t)`` in place; default ``nn.Linear``'s uniform(+-1/sqrt(fan_in))), so a
    model's initial weights do not depend on tp."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if init_method is not None:
        init_method(t)
    else:
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(t, -bound, bound)
    return t


class OverlapPlan:
    """How a layer overlaps its collectives: ``overlap`` ("auto" | "chunked" | "none"),
    ``chunks``, the tp group, and the :class:`OverlapStats` of what ran.

    ``auto`` measures on the first call per (layer kind, direction, collective, rows rounded
    up to a power of two, K, N, dtype, device, group) and reuses the choice for the shapes
    that share that key (so variable sequence lengths do not re-measure on every call)."""

    def __init__(self, dims, overlap: str, chunks: int, name: str):
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap={overlap!r}: use one of {OVERLAP_MODES}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: it must be a positive integer (e.g. 2 or 4)")
        self.group = dims.tp_group
        self.tp = dims.tp
        self.overlap, self.chunks, self.name = overlap, chunks, name
        self.stats = OverlapStats()
        self._comm: CommContext | None = None

    @property
    def comm(self) -> CommContext:
        if self._comm is None:
            self._comm = CommContext(self.group)
        return self._comm

    def run(self, direction: str, kind: str, a: torch.Tensor, mm, n_out: int, then=None):
        """Run the engine ``kind`` on ``a`` with this plan's schedule; count it."""
        comm, est, reason = self.comm, 0.0, ""
        if self.overlap == "none":
            chunks, reason = 0, "overlap='none'"
        elif self.overlap == "chunked":
            chunks = self.chunks
        else:
            rows = a.shape[0] if kind == "all_reduce" else a.shape[1] // (
                self.tp if kind == "reduce_scatter" else 1)
            m = a.numel() // max(a.shape[-1], 1)  # rows: a new measurement per power of two
            key = (self.name, direction, kind, 1 << max(m - 1, 0).bit_length(), a.shape[-1],
                   n_out, str(a.dtype), a.device.type)
            choice = autotune.choose(
                key, lambda c, ch: run_engine(kind, a, mm, n_out, c, ch, then), comm, rows,
                a.device, f"{self.name} {direction}", chunks_hint=self.chunks)
            chunks, est, reason = choice.chunks, choice.comm_ms, choice.reason
        comm.wait_ms = 0.0
        out = run_engine(kind, a, mm, n_out, comm, chunks, then)
        counter = getattr(self.stats, direction)
        counter.record("chunked" if chunks else "none", chunks,
                       comm.wait_ms if not a.is_cuda else 0.0, est)
        counter.reason = reason
        return out


def _mm_t(w: torch.Tensor):
    """``out = a @ w.T`` into a preallocated row slice: ``(m, in) @ (in, out)``."""
    return lambda a, o: torch.mm(a, w.t(), out=o)


def _mm(w: torch.Tensor):
    """``out = a @ w``: ``(m, out) @ (out, in)``, the input-gradient GEMM."""
    return lambda a, o: torch.mm(a, w, out=o)


class _ColumnParallelMatmul(torch.autograd.Function):
    """Y = X @ W_r^T (+ b_r) with W_r = this rank's rows of W; see the module table."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, plan, sp):
        n, k = weight.shape  # (N/tp, K)
        x = x.contiguous()
        if sp:  # (b, s/tp, K) -> all-gather + GEMM -> (b, s, N/tp)
            (x_full, out), _ = plan.run("forward", "all_gather", x, _mm_t(weight), n)
        else:  # (..., K) @ (K, N/tp)
            x_full, out = x, torch.mm(x.reshape(-1, k), weight.t()).view(*x.shape[:-1], n)
        if bias is not None:
            out = out.add_(bias)
        ctx.save_for_backward(x_full, weight)
        ctx.plan, ctx.sp, ctx.has_bias, ctx.x_shape = plan, sp, bias is not None, x.shape
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, gy):
        x_full, w = ctx.saved_tensors
        n, k = w.shape
        gy = gy.contiguous()
        g2, x2 = gy.reshape(-1, n), x_full.reshape(-1, k)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]

        def wgrad():  # (N/tp, M) @ (M, K) and the bias row-sum
            gw = g2.t() @ x2 if need_w else None
            return gw, (g2.sum(0) if need_b else None)

        if not need_x:
            gw, gb = wgrad()
            return None, gw, gb, None, None
        if ctx.sp:  # dX partial (b, s, K) -> reduce-scatter -> (b, s/tp, K)
            gx, (gw, gb) = ctx.plan.run("backward", "reduce_scatter", gy, _mm(w), k, wgrad)
        else:  # dX partial (M, K) -> all-reduce, overlapped with dW
            gx, (gw, gb) = ctx.plan.run("backward", "all_reduce", g2, _mm(w), k, wgrad)
            gx = gx.view(ctx.x_shape)
        return gx, gw, gb, None, None


class _RowParallelMatmul(torch.autograd.Function):
    """Y = sum_r X_r @ W_r^T (+ b) with W_r = this rank's columns of W; see the module table."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, plan, sp):
        n, k = weight.shape  # (N, K/tp)
        x = x.contiguous()
        if sp:  # (b, s, K/tp) -> GEMM + reduce-scatter -> (b, s/tp, N)
            out, _ = plan.run("forward", "reduce_scatter", x, _mm_t(weight), n)
        else:  # (M, K/tp) @ (K/tp, N) -> all-reduce -> (..., N)
            out, _ = plan.run("forward", "all_reduce", x.reshape(-1, k), _mm_t(weight), n)
            out = out.view(*x.shape[:-1], n)
        if bias is not None:
            out = out.add_(bias)
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.sp, ctx.has_bias = plan, sp, bias is not None
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        n, k = w.shape
        gy = gy.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gb, bias_work = None, None
        if need_b:  # replicated bias: under sp each rank holds a partial sum
            gb = gy.reshape(-1, n).sum(0)
            if ctx.sp:
                bias_work = dist.all_reduce(gb, group=ctx.plan.group, async_op=True)
        if ctx.sp:  # dY (b, s/tp, N) -> all-gather overlapped with dX = dY @ W
            if need_x or need_w:
                (gy_full, gx), _ = ctx.plan.run("backward", "all_gather", gy, _mm(w), k)
            gy2 = gy_full.reshape(-1, n) if need_w else None
        else:
            gy2 = gy.reshape(-1, n)
            gx = (gy2 @ w).view(x.shape) if need_x else None  # (M, N) @ (N, K/tp)
        gw = gy2.t() @ x.reshape(-1, k) if need_w else None  # (N, M) @ (M, K/tp)
        if bias_work is not None:
            bias_work.wait()
        return (gx if need_x else None), gw, gb, None, None


def column_parallel_matmul(x, weight, bias, plan: OverlapPlan, sequence_parallel: bool):
    """Autograd entry of the column-parallel GEMM (see the module table for collectives)."""
    return _ColumnParallelMatmul.apply(x, weight, bias, plan, sequence_parallel)


def row_parallel_matmul(x, weight, bias, plan: OverlapPlan, sequence_parallel: bool):
    """Autograd entry of the row-parallel GEMM (see the module table for collectives)."""
    return _RowParallelMatmul.apply(x, weight, bias, plan, sequence_parallel)
