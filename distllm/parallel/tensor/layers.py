"""The tensor-parallel layers' GEMMs with their communication: the overlap plan of a layer,
the record of what it ran, and the autograd Functions of the column- and row-parallel GEMMs
that drive the engines of :mod:`distllm.parallel.tensor.overlap`. The modules users build
models from (``ColumnParallelLinear``, ``RowParallelLinear``) live in :mod:`distllm.nn`.

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

In zb-h1's forward (:mod:`distllm.ops.weight_grad`) both leave their weight-gradient
GEMM to the W pass: the column-parallel backward then runs dX's collective alone, and W
needs no collective (a row-parallel bias's gradient, all-reduced under sp, stays in B).

Each direction's :class:`OverlapCounter` records the collective that actually ran
(``collective``), set by the code path that ran it, which the overlap doctor
(:mod:`distllm.diagnostics`) reports.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from distllm.comm.collectives import all_reduce
from distllm.diagnostics.timing import max_over_ranks
from distllm.ops import cpu_gemm
from distllm.ops.weight_grad import leave_to_w, trained, weight_grad_store
from distllm.parallel.tensor import overlap_tuner
from distllm.parallel.tensor.batch_split import deferring
from distllm.parallel.tensor.mappings import differentiable_once
from distllm.parallel.tensor.overlap import CommContext, run_engine

__all__ = ["OVERLAP_MODES", "COLLECTIVES", "OverlapCounter", "OverlapStats", "OverlapPlan",
           "column_parallel_matmul", "row_parallel_matmul", "overlap_plans", "overlap_tuning",
           "settle_overlap"]

OVERLAP_MODES = ("auto", "chunked", "none")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "none")  # what a direction ran


@dataclass
class OverlapCounter:
    """What one direction (forward or backward) of a layer ran, accumulated over calls.

    Fields: ``calls`` (calls through an overlap engine, or deferred by batch-split overlap);
    ``overlapped`` (those that ran an overlapped schedule); ``mode`` and ``chunks`` of the
    last such call (``mode`` is ``chunked``, ``none``, or ``deferred``: a forward all-reduce
    left in flight while the batch's next part computes, see
    :mod:`distllm.parallel.tensor.batch_split`); ``collective`` the layer's collective in
    the last call of this direction, engine or not (one of :data:`COLLECTIVES`; ``none``
    until one ran);
    ``wait_ms`` the host time blocked waiting on collectives (CPU only: on CUDA the host does
    not block, and ``on_cuda`` is set); ``comm_ms_est`` the standalone communication time of
    these calls as measured by ``overlap="auto"`` (0 when not measured); ``reason`` why
    overlap is off, if it is;
    ``growth`` the piece sizes of the last call's chunked schedule (the ratio of the
    geometric schedule ``overlap="auto"`` chose, or None: equal pieces, the first and last
    halved).
    """

    calls: int = 0
    overlapped: int = 0
    mode: str = "none"
    chunks: int = 0
    collective: str = "none"
    wait_ms: float = 0.0
    comm_ms_est: float = 0.0
    reason: str = ""
    growth: float | None = None
    on_cuda: bool = False

    @property
    def hidden_ms(self) -> float | None:
        """Estimated communication time hidden behind compute (``comm_ms_est - wait_ms``; 0
        when no call overlapped: a blocking collective hides nothing, whatever the timers say
        when a peer arrives late). None when not measured, or on CUDA: there the wait is the
        stream's, not the host's, so the host's timer would read every call as wholly hidden
        (a profiler trace says what hid: ``distllm bench --doctor``)."""
        if not self.comm_ms_est or self.on_cuda:
            return None
        if not self.overlapped:
            return 0.0
        return max(0.0, self.comm_ms_est - self.wait_ms)

    @property
    def hidden_frac(self) -> float | None:
        h = self.hidden_ms
        return None if h is None else h / self.comm_ms_est

    def record(self, mode: str, chunks: int, collective: str, wait_ms: float,
               comm_ms_est: float = 0.0, on_cuda: bool = False) -> None:
        """Count one call through an overlap engine (``on_cuda``: its wait was not timed)."""
        self.calls += 1
        self.on_cuda |= on_cuda
        self.overlapped += mode in ("chunked", "deferred")
        self.mode, self.chunks, self.collective = mode, chunks, collective
        self.wait_ms += wait_ms
        self.comm_ms_est += comm_ms_est


@dataclass
class OverlapStats:
    """Per-layer record of overlap: ``forward`` and ``backward`` :class:`OverlapCounter`,
    and ``kernel``: what computes a layer with a fused epilogue (the backend, fused or not,
    as ``backend="auto"`` resolved it; empty for a plain GEMM)."""

    forward: OverlapCounter = field(default_factory=OverlapCounter)
    backward: OverlapCounter = field(default_factory=OverlapCounter)
    kernel: str = ""

    def reset(self) -> None:
        """Clear the counters (``kernel`` describes the layer and stays)."""
        self.forward, self.backward = OverlapCounter(), OverlapCounter()

    def as_dict(self) -> dict:
        out = {"kernel": self.kernel}
        for name in ("forward", "backward"):
            c = getattr(self, name)
            out[name] = {**asdict(c), "hidden_ms": c.hidden_ms, "hidden_frac": c.hidden_frac}
        return out


class OverlapPlan:
    """How a layer overlaps its collectives: ``overlap`` ("auto" | "chunked" | "none"),
    ``chunks`` (row pieces of the GEMM), the tp group, and the :class:`OverlapStats` of what
    ran.

    ``auto`` measures on the first call per (layer kind, direction, collective, rows rounded
    up to a power of two, K, N, dtype, device, group) and reuses the choice for the shapes
    that share that key (so variable sequence lengths do not re-measure on every call)."""

    def __init__(self, dims, overlap: str, chunks: int, name: str):
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap={overlap!r}: use one of {OVERLAP_MODES}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r}: it must be a positive integer (e.g. 2 or 4)")
        self.group = dims.tp_group
        self.tp = dims.tp
        self.overlap, self.chunks, self.name = overlap, chunks, name
        self.stats = OverlapStats()
        self._comm: CommContext | None = None
        self._memo: dict[tuple, tuple[int, tuple]] = {}  # per exact call: (generation, plan)
        self._trials: dict[str, overlap_tuner.Trial] = {}  # direction: its last call's trial

    def __deepcopy__(self, memo: dict) -> OverlapPlan:
        """A copy for a copied layer: the same group and :class:`CommContext` (process
        groups cannot be copied), its own record of what ran."""
        new = copy.copy(self)
        new.stats = copy.deepcopy(self.stats, memo)
        new._memo, new._trials = dict(self._memo), dict(self._trials)
        return new

    @property
    def comm(self) -> CommContext:
        if self._comm is None:
            self._comm = CommContext(self.group)
        return self._comm

    def ran(self, direction: str, collective: str) -> None:
        """Note the collective of a ``direction`` that did not go through an engine (``none``
        for a GEMM alone; ``all_reduce`` for the f operator's backward)."""
        getattr(self.stats, direction).collective = collective

    def _schedule(self, direction: str, kind: str, a: torch.Tensor, mm, n_out: int, then
                  ) -> tuple[int, float, str, float | None, overlap_tuner.Trial | None]:
        """``(chunks, measured comm ms, reason, growth, trial)`` of this call (chunks 0:
        sequential; growth: the geometric schedule's ratio, None for first/last halved;
        trial: the running trial this call is part of, or None)."""
        if self.overlap == "none":
            return 0, 0.0, "overlap='none'", None, None
        if self.overlap == "chunked":
            return self.chunks, 0.0, "", None, None
        # work after the collective (``then``) makes one piece a candidate: its own choice
        one_piece = then is not None and kind != "all_gather"
        memo_key = (direction, kind, a.shape, a.dtype, a.device, n_out, one_piece)
        gen = overlap_tuner.generation()
        hit = self._memo.get(memo_key)
        if hit is not None and hit[0] == gen:  # this exact call's choice: no key to rebuild
            return hit[1]
        rows = a.shape[0] if kind == "all_reduce" else a.shape[1] // (
            self.tp if kind == "reduce_scatter" else 1)
        m = a.numel() // max(a.shape[-1], 1)  # rows: a new measurement per power of two
        # ... of the rows and of those the engine chunks (the sequence's under sequence
        # parallelism: (8, s) and (1, 8s) have the GEMM's rows, not its chunks)
        key = (self.name, direction, kind, 1 << max(m - 1, 0).bit_length(),
               1 << max(rows - 1, 0).bit_length(), a.shape[-1], n_out, str(a.dtype),
               a.device.type, one_piece)
        choice = overlap_tuner.choose(
            key, lambda c, ch, g=None: run_engine(kind, a, mm, n_out, c, ch, then, g),
            self.comm, rows, a.device, f"{self.name} {direction}", chunks_hint=self.chunks,
            comm_first=kind == "all_gather", one_piece=one_piece)
        trial = choice.trial
        if trial is not None:  # not memoised: each call of the trial asks the cache again
            name, chunks, growth = trial.schedule()
            return (chunks, choice.comm_ms, f"trial in the step: {name}, call "
                    f"{trial.calls + 1} of {trial.total_calls}", growth, trial)
        out = (choice.chunks, choice.comm_ms, choice.reason, choice.growth, None)
        self._memo[memo_key] = (gen, out)
        return out

    def run(self, direction: str, kind: str, a: torch.Tensor, mm, n_out: int, then=None):
        """Run the engine of collective ``kind`` on ``a`` with this plan's schedule; count it
        in ``stats.<direction>``."""
        chunks, est, reason, growth, trial = self._schedule(direction, kind, a, mm, n_out,
                                                            then)
        comm = self.comm
        comm.wait_ms = 0.0
        call = lambda: run_engine(kind, a, mm, n_out, comm, chunks, then, growth)  # noqa: E731
        # a call of a trial is timed, and the trial's last call decides (collective)
        out = call() if trial is None else trial.run(call, comm)
        counter = getattr(self.stats, direction)
        counter.record("chunked" if chunks else "none", chunks, kind,
                       comm.wait_ms if not a.is_cuda else 0.0, est, on_cuda=a.is_cuda)
        counter.reason, counter.growth = reason, growth
        if trial is not None:
            self._trials[direction] = trial
        else:
            self._trials.pop(direction, None)
        return out

    def launch_deferred(self, a: torch.Tensor, mm, lead: torch.Size, n_out: int,
                        deferred) -> torch.Tensor:
        """The forward of batch-split overlap (:mod:`distllm.parallel.tensor.batch_split`):
        the whole GEMM ``a @ B`` of ``a`` ``(M, K)`` (``mm`` as the engines take it) into a
        new ``(*lead, n_out)`` tensor, then its all-reduce launched and recorded in
        ``deferred``; returns that partial sum (not a view: it is summed in place when
        ``deferred.finish`` waits, which autograd forbids on a custom Function's view)."""
        out = a.new_empty(*lead, n_out)
        mm(a, out.view(-1, n_out))
        # the sum lands through ``.data``: no version bump, so that an alias of ``out`` made
        # before the wait (a full backward hook's view of the module output) stays usable
        deferred.launched(self, self.comm.launch("all_reduce", out.data), out)
        c = self.stats.forward
        c.record("deferred", 0, "all_reduce", 0.0, on_cuda=a.is_cuda)
        c.reason, c.growth = ("batch split: the all-reduce runs while the batch's next part "
                              "computes", None)
        return out

    def wait_deferred(self, handle) -> None:
        """Wait for an all-reduce of :meth:`launch_deferred` (host time in ``wait_ms``)."""
        comm = self.comm
        comm.wait_ms = 0.0
        comm.wait(handle)
        if handle.event is None:  # on CUDA the host does not block
            self.stats.forward.wait_ms += comm.wait_ms

    @property
    def tuning(self) -> bool:
        """Whether ``overlap="auto"``'s trial in the step that this layer's last calls took
        part in is still running (its next calls still alternate between schedules; see
        :mod:`distllm.parallel.tensor.overlap_tuner`)."""
        return any(not t.done for t in self._trials.values())


def overlap_plans(of) -> list[OverlapPlan]:
    """The :class:`OverlapPlan` of every tensor-parallel layer of ``of``: a module, a plan, or
    a list of them."""
    if isinstance(of, OverlapPlan):
        return [of]
    if isinstance(of, (list, tuple)):
        return [p for o in of for p in overlap_plans(o)]
    return [p for m in of.modules() if isinstance(p := getattr(m, "plan", None), OverlapPlan)]


def overlap_tuning(of) -> bool:
    """Whether a tensor-parallel layer of ``of`` (a module, an :class:`OverlapPlan`, or a list
    of them) is in the middle of ``overlap="auto"``'s trial in the step, on this rank."""
    return any(p.tuning for p in overlap_plans(of))


def settle_overlap(step_fn: Callable[[], object], of, group=None, max_calls: int = 64) -> int:
    """Call ``step_fn`` once, then again while a layer of ``of`` (as in
    :func:`overlap_tuning`) is in ``overlap="auto"``'s trial on some rank of ``group`` (default:
    the world), at most ``max_calls`` times in all; the number of calls. For benchmarks and
    diagnostics, whose timed steps should run the schedules ``auto`` settled on. Collective
    over ``group``: one all-reduce of a flag after each call."""
    calls = 0
    while True:
        step_fn()
        calls += 1
        if calls >= max_calls or not max_over_ranks([float(overlap_tuning(of))], group)[0]:
            return calls


def _mm_t(w: torch.Tensor, bias: torch.Tensor | None = None
          ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``out = a @ w.T (+ bias)`` into a preallocated row slice: ``(m, in) @ (in, out)`` (on
    CPU through oneDNN or torch's GEMM, whichever measured faster:
    :mod:`distllm.ops.cpu_gemm`); the bias in the GEMM, so bf16/fp16 rounds once."""
    return lambda a, o: cpu_gemm.mm_t(a, w, out=o, bias=bias)


def _mm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``out = a @ w``: ``(m, out) @ (out, in)``, the input-gradient GEMM (on CPU as
    :func:`_mm_t`)."""
    return lambda a, o: cpu_gemm.mm(a, w, out=o)


def _check_k(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    """ValueError, before any GEMM or collective, unless ``x`` (..., K) fits ``weight``
    (N, K), in its dtype (outside autocast)."""
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{what}: input of shape {tuple(x.shape)} does not fit this rank's "
                         f"weight {tuple(weight.shape)}: its last dim must be "
                         f"{weight.shape[1]}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{what}: the input is {x.dtype} and the layer's weight "
                         f"{weight.dtype}: cast the input (x.to({weight.dtype})) or the layer "
                         f"(layer.to({x.dtype}))")


class _ColumnParallelMatmul(torch.autograd.Function):
    """Y = X @ W_r^T (+ b_r) with W_r = this rank's rows of W; see the module table."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, plan, sp):
        n, k = weight.shape  # (N/tp, K)
        x = x.contiguous()
        # the bias (this rank's columns) in each GEMM: one rounding in bf16/fp16, as F.linear
        if sp:  # (b, s/tp, K) -> all-gather + GEMM -> (b, s, N/tp)
            (x_full, out), _ = plan.run("forward", "all_gather", x, _mm_t(weight, bias), n)
        else:  # (..., K) @ (K, N/tp)
            out = cpu_gemm.mm_t(x.reshape(-1, k), weight, bias=bias)
            x_full, out = x, out.view(*x.shape[:-1], n)
            plan.ran("forward", "none")
        ctx.save_for_backward(x_full, weight)
        ctx.plan, ctx.sp, ctx.has_bias, ctx.x_shape = plan, sp, bias is not None, x.shape
        ctx.store, ctx.params = weight_grad_store(weight), (weight, trained(bias))
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, gy):
        x_full, w = ctx.saved_tensors
        n, k = w.shape
        gy = gy.contiguous()
        g2, x2 = gy.reshape(-1, n), x_full.reshape(-1, k)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]

        def wgrad(need_w=need_w, need_b=need_b):  # (N/tp, M) @ (M, K), the bias row-sum
            gw = g2.t() @ x2 if need_w else None
            return gw, (g2.sum(0) if need_b else None)

        then, later = wgrad, None
        if ctx.store is not None and need_w:  # zb-h1: left to W, dX's collective alone
            b_later = leave_to_w(ctx.store, *ctx.params, need_b, lambda b: wgrad(True, b))
            then, later = None, (None, g2.sum(0) if need_b and not b_later else None)
        if not need_x:
            ctx.plan.ran("backward", "none")
            gw, gb = later or wgrad()
            return None, gw, gb, None, None
        if ctx.sp:  # dX partial (b, s, K) -> reduce-scatter -> (b, s/tp, K)
            gx, wg = ctx.plan.run("backward", "reduce_scatter", gy, _mm(w), k, then)
        else:  # dX partial (M, K) -> all-reduce, overlapped with dW
            gx, wg = ctx.plan.run("backward", "all_reduce", g2, _mm(w), k, then)
            gx = gx.view(ctx.x_shape)
        gw, gb = later or wg
        return gx, gw, gb, None, None


class _RowParallelMatmul(torch.autograd.Function):
    """Y = sum_r X_r @ W_r^T (+ b) with W_r = this rank's columns of W; see the module table."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, plan, sp):
        n, k = weight.shape  # (N, K/tp)
        x = x.contiguous()
        deferred = None if sp else deferring()
        if sp:  # (b, s, K/tp) -> GEMM + reduce-scatter -> (b, s/tp, N)
            out, _ = plan.run("forward", "reduce_scatter", x, _mm_t(weight), n)
        elif deferred is not None:  # batch split: the all-reduce is waited for later
            if bias is not None:  # it would land on a partial sum still being reduced
                raise RuntimeError("a deferred all-reduce takes its bias later: pass "
                                   "bias=None and register it with add_bias_later")
            out = plan.launch_deferred(x.reshape(-1, k), _mm_t(weight), x.shape[:-1], n,
                                       deferred)
        else:  # (M, K/tp) @ (K/tp, N) -> all-reduce -> (..., N)
            out, _ = plan.run("forward", "all_reduce", x.reshape(-1, k), _mm_t(weight), n)
            out = out.view(*x.shape[:-1], n)
        if bias is not None:
            out = out.add_(bias)
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.sp, ctx.has_bias = plan, sp, bias is not None
        ctx.store, ctx.weight = weight_grad_store(weight), weight
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        n, k = w.shape
        gy = gy.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gb, bias_work = None, None
        if need_b:  # replicated bias: under sp each rank holds a partial sum
            gb = gy.reshape(-1, n).sum(0)
            if ctx.sp:
                bias_work = all_reduce(gb, group=ctx.plan.group, async_op=True)
        if ctx.sp and (need_x or need_w):  # dY (b, s/tp, N) -> all-gather, overlapped with dX
            (gy_full, gx), _ = ctx.plan.run("backward", "all_gather", gy, _mm(w), k)
            gy2 = gy_full.reshape(-1, n)
        else:
            ctx.plan.ran("backward", "none")
            gy2 = gy.reshape(-1, n)
            gx = cpu_gemm.mm(gy2, w).view(x.shape) if need_x else None  # (M, N) @ (N, K/tp)
        gw = None
        if need_w and ctx.store is not None:  # zb-h1: left to W (the bias's stays here)
            ctx.store.defer((ctx.weight,), lambda: (gy2.t() @ x.reshape(-1, k),))
        elif need_w:
            gw = gy2.t() @ x.reshape(-1, k)  # (N, M) @ (M, K/tp)
        if bias_work is not None:
            bias_work.wait()
        return (gx if need_x else None), gw, gb, None, None


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           plan: OverlapPlan, sequence_parallel: bool) -> torch.Tensor:
    """Autograd entry of the column-parallel GEMM (see the module table for collectives)."""
    _check_k(x, weight, "column_parallel_matmul")
    if sequence_parallel and plan.tp > 1 and x.dim() != 3:
        raise ValueError(f"column_parallel_matmul: under sequence_parallel the input is "
                         f"(batch, seq/tp, k), this rank's part of the sequence (all-gathered "
                         f"here); got {tuple(x.shape)}")
    return _ColumnParallelMatmul.apply(x, weight, bias, plan, sequence_parallel)


def row_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        plan: OverlapPlan, sequence_parallel: bool) -> torch.Tensor:
    """Autograd entry of the row-parallel GEMM (see the module table for collectives)."""
    _check_k(x, weight, "row_parallel_matmul")
    if sequence_parallel and plan.tp > 1 and (x.dim() != 3 or x.shape[1] % plan.tp):
        raise ValueError(f"row_parallel_matmul: under sequence_parallel the input is (batch, "
                         f"seq, k) with seq divisible by tp={plan.tp} (its output is "
                         f"scattered over the sequence); got {tuple(x.shape)}: choose seq_len "
                         f"a multiple of {plan.tp}")
    return _RowParallelMatmul.apply(x, weight, bias, plan, sequence_parallel)
