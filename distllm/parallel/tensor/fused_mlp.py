"""The column-parallel GEMM fused with its bias and GeLU in every overlap mode, and the
tensor-parallel MLP whose backward is fused across its two GEMMs.

Two autograd Functions over the engines of :mod:`distllm.parallel.tensor.overlap`:

* :func:`column_parallel_linear_gelu`: ``y = gelu(x W_r^T + b_r)`` on this rank's rows of
  ``W``. Forward: the fused op ``distllm::linear_gelu_fwd`` on the local input (no
  collective), or, under sequence parallelism, on each all-gathered chunk as it arrives
  (bias and GeLU in the GEMM's epilogue, the pre-activation kept for the backward).
  Backward: ``gu = grad * gelu'(pre)`` in one pass (with the bias gradient, on Triton), then
  the input-gradient GEMM ``gu @ W_r`` with its all-reduce (sequence parallel:
  reduce-scatter) chunked and overlapped with the weight-gradient GEMM.
* :func:`parallel_mlp`: ``fc2(gelu(fc1(x)))`` with ``fc1`` as above and ``fc2``
  row-parallel (all-reduce, or reduce-scatter under sequence parallelism, chunked and
  overlapped with its GEMM). Its backward fuses the GeLU derivative and fc1's bias gradient
  into fc2's input-gradient GEMM (``distllm::gemm_dgelu``: cuBLASLt's DGELU_BGRAD epilogue
  reading the pre-activation that the forward's GELU_AUX_BIAS saved, a Triton GEMM with the
  same epilogue, or the GEMM and one pass on CPU), as TransformerEngine's LayerNormMLP does;
  under sequence parallelism each all-gathered chunk of the output gradient goes through
  that fused GEMM as it arrives. fc1's input gradient then overlaps its collective with
  fc1's weight-gradient GEMM as above.

``backend`` is that of :func:`distllm.ops.linear_gelu` ("auto", "cuda", "triton", "cpu",
"reference"). "auto" resolves once per shape, dtype and device by timing the whole local
call (forward, plus backward in training) of each backend that can serve the inputs, the
unfused reference among them, so it may choose the unfused path where that measured faster;
the layer's ``OverlapStats.kernel`` says what ran. "reference" is the unfused path: the
GEMM, then GeLU (its derivative in backward) as separate passes.

Saved for backward: the (gathered) input, the pre-activation and, in the MLP, the GeLU
output (fc2's weight gradient needs it), as the unfused layers save them.

In zb-h1's forward (:mod:`distllm.ops.weight_grad`) the weight-gradient GEMMs (fc1's
with its bias sum where B's kernel did not fuse it) are left to the W pass; B runs the
input-gradient GEMMs and their collectives alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from distllm.comm.collectives import all_reduce
from distllm.ops import backend_choice, cpu_gemm
from distllm.ops import linear_gelu_backends as impl
from distllm.ops.weight_grad import leave_to_w, trained, weight_grad_store
from distllm.parallel.tensor.batch_split import deferring
from distllm.parallel.tensor.layers import OverlapPlan, _mm, _mm_t
from distllm.parallel.tensor.mappings import differentiable_once

__all__ = ["BACKENDS", "resolve_backend", "column_parallel_linear_gelu", "parallel_mlp",
           "dense_mlp", "single_device_plans", "describe_kernel"]

BACKENDS = ("auto", *impl.BACKENDS)
_RESOLVED: dict[tuple, tuple[int, str]] = {}  # "auto"'s choice per local problem, its rows
# rounded up to a power of two as in the choice's own key (backend_choice.rows_bucket)


def resolve_backend(backend: str, x2: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, approximate: str, needs_grad: bool) -> str:
    """The concrete backend of a fused layer for this local problem (``x2`` (M, K) on
    ``weight`` (N, K)); an explicit one that cannot serve the inputs is a ValueError naming
    the ``backend`` argument and the backends that can. Inputs of another dtype than the
    weight (outside autocast) are a ValueError saying so, before anything is timed."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)}")
    mixed = x2.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype)
    if mixed and not torch.is_autocast_enabled(x2.device.type):
        raise ValueError(f"the input is {x2.dtype} and the layer's weight {weight.dtype}"
                         + (f", its bias {bias.dtype}" if bias is not None else "")
                         + f": cast the input (x.to({weight.dtype})) or the layer "
                         f"(layer.to({x2.dtype}))")
    if backend == "auto" and torch.compiler.is_compiling():
        return "reference"  # first: nothing below is for a graph (fullgraph=True)
    # from the module (the package's attribute of that name is the function)
    from distllm.ops.linear_gelu import _auto_candidates, _choose_end_to_end, _require

    if backend == "auto":
        if is_fake(x2):  # a dry run on fake tensors: nothing to time; the first candidate
            return _auto_candidates(x2, weight, approximate)[0]
        # every forward asks: a memo per problem spares the choice's string key; per bucket
        # of rows, so that varying sequence lengths neither re-measure nor grow the memo
        key = (backend_choice.rows_bucket(x2.shape[0]), x2.shape[1], weight.shape, x2.dtype,
               x2.device, bias is not None, approximate, needs_grad, torch.get_num_threads())
        gen = backend_choice.generation()
        hit = _RESOLVED.get(key)
        if hit is not None and hit[0] == gen:
            return hit[1]
        name = _choose_end_to_end(x2, weight, bias, approximate, needs_grad)
        _RESOLVED[key] = (gen, name)
        return name
    _require(backend, x2, weight, approximate)
    return backend


def describe_kernel(backend: str) -> str:
    """What a resolved backend runs, for ``OverlapStats.kernel``."""
    if backend == "reference":
        return "reference: unfused (GEMM, then GeLU)"
    return f"{backend}: fused GEMM + bias + GeLU"


class _FusedChunks:
    """All-gather engine callback of the sequence-parallel forward: ``gelu(rows @ W^T + b)``
    per chunk through the fused op, each chunk's pre-activation written where its rows sit
    in the full sequence (``pre``: ``(b, tp, s/tp, N)``)."""

    def __init__(self, x_local, weight, bias, approximate, backend, tp, keep):
        b, sl, _ = x_local.shape
        n = weight.shape[0]
        self.w, self.b, self.approximate, self.backend, self.keep = (
            weight, bias, approximate, backend, keep)
        self.pre = x_local.new_empty(b, tp, sl, n) if keep else None
        self.where = (0, 0, sl)

    def at(self, q: int, s: int, e: int) -> None:
        self.where = (q, s, e)

    def produce(self, rows: torch.Tensor) -> torch.Tensor:
        y, pre = torch.ops.distllm.linear_gelu_fwd(rows, self.w, self.b, self.approximate,
                                                   self.backend, self.keep)
        if self.keep:
            q, s, e = self.where
            self.pre[:, q, s:e] = pre.view(self.pre.shape[0], e - s, -1)
        return y


class _DgeluChunks:
    """All-gather engine callback of the sequence-parallel MLP backward: each arriving chunk
    of fc2's output gradient through the GEMM with the GeLU-derivative epilogue, reading the
    pre-activation rows it belongs to; the bias parts are kept per chunk and summed in a
    fixed order."""

    def __init__(self, w2, pre, has_bias, approximate, backend):
        self.w2, self.pre, self.has_bias = w2, pre, has_bias  # pre: (b, tp, s/tp, N)
        self.approximate, self.backend = approximate, backend
        self.parts: dict[tuple[int, int, int], torch.Tensor] = {}
        self.where = (0, 0, pre.shape[2])

    def begin(self) -> None:
        self.parts = {}

    def at(self, q: int, s: int, e: int) -> None:
        self.where = (q, s, e)

    def produce(self, rows: torch.Tensor) -> torch.Tensor:
        q, s, e = self.where
        pre = self.pre[:, q, s:e].reshape(rows.shape[0], -1)
        gu, db = torch.ops.distllm.gemm_dgelu(rows, self.w2, pre, self.has_bias,
                                              self.approximate, self.backend)
        if self.has_bias:
            self.parts[self.where] = db
        return gu

    def bias_grad(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        keys = sorted(self.parts)
        total = self.parts[keys[0]].clone()
        for key in keys[1:]:
            total += self.parts[key]
        return total


def _fc1_forward(plan: OverlapPlan, x, w, b, sp, approximate, backend, keep):
    """``(x_full, y, pre)`` of the fused column-parallel forward (``pre`` None unless kept)."""
    n, k = w.shape
    if sp:  # (b, s/tp, K) -> all-gather, chunk by chunk through the fused GEMM -> (b, s, N/tp)
        fused = _FusedChunks(x, w, b, approximate, backend, plan.tp, keep)
        (x_full, y), _ = plan.run("forward", "all_gather", x, fused, n)
        pre = None if fused.pre is None else fused.pre.view(y.shape)
        return x_full, y, pre
    y, pre = torch.ops.distllm.linear_gelu_fwd(x.reshape(-1, k), w, b, approximate, backend,
                                               keep)
    plan.ran("forward", "none")
    return x, y.view(*x.shape[:-1], n), (pre if keep else None)


def _fc1_backward(ctx_plan: OverlapPlan, sp, gu, db, x_full, w, has_bias, needs, x_shape,
                  backend, store=None, params=(None, None)):
    """``(dx, dw, db)`` of the column-parallel layer from ``gu`` (M, N/tp), the gradient of
    its pre-activation (``db``: its column sum if already computed): dX's all-reduce (or
    reduce-scatter) overlapped with the weight-gradient GEMM, or, with a zb-h1 ``store``
    (:mod:`distllm.ops.weight_grad`), that GEMM left to W for ``params`` (the weight
    and bias leaves) and the collective alone."""
    need_x, need_w, need_b = needs
    n, k = w.shape
    x2 = x_full.reshape(-1, k)
    bias_now = need_b and has_bias and db is None

    def wgrad(need_w=need_w, bias_now=bias_now):  # (N/tp, M) @ (M, K), with the bias
        # gradient where the backend fuses it
        dw, db_w = impl.wgrad(backend, gu, x2, bias_now) if need_w else (None, None)
        if bias_now and db_w is None:
            db_w = gu.sum(0)
        return dw, (db if db is not None else db_w)

    then, later = wgrad, None
    if store is not None and need_w:  # a bias that is no leaf (a cast) gets its grad here
        b_later = leave_to_w(store, *params, bias_now, lambda b: wgrad(True, b))
        then = None
        later = (None, db if db is not None else
                 gu.sum(0) if bias_now and not b_later else None)
    if not need_x:
        ctx_plan.ran("backward", "none")
        dw, db = later or wgrad()
        return None, dw, db
    if ctx_plan.tp == 1:
        ctx_plan.ran("backward", "none")
        dx = impl.dgrad(backend, gu, w).view(x_shape)
        dw, db = later or wgrad()
        return dx, dw, db
    if sp:  # dX partial (b, s, K) -> reduce-scatter -> (b, s/tp, K), overlapped with dW
        dx, wg = ctx_plan.run("backward", "reduce_scatter",
                              gu.view(x_full.shape[0], -1, n), _mm(w), k, then)
        dw, db = later or wg
        return dx, dw, db
    dx, wg = ctx_plan.run("backward", "all_reduce", gu, _mm(w), k, then)
    dw, db = later or wg
    return dx.view(x_shape), dw, db


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


class _ColumnParallelLinearGeLU(torch.autograd.Function):
    """``gelu(x W_r^T + b_r)``, fused in every mode; see the module docstring."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, plan, sp, approximate, backend, keep):
        x = x.contiguous()
        x_full, y, pre = _fc1_forward(plan, x, weight, bias, sp, approximate, backend, keep)
        ctx.save_for_backward(x_full, weight, pre)
        ctx.plan, ctx.sp, ctx.approximate, ctx.backend = plan, sp, approximate, backend
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        ctx.store, ctx.params = weight_grad_store(weight), (weight, trained(bias))
        return y

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, gy):
        x_full, w, pre = ctx.saved_tensors
        n = w.shape[0]
        need_b = ctx.needs_input_grad[2] and ctx.has_bias
        gu, db = impl.gelu_grad(ctx.backend, gy.reshape(-1, n), pre.reshape(-1, n), need_b,
                                ctx.approximate)
        dx, dw, db = _fc1_backward(ctx.plan, ctx.sp, gu, db, x_full, w, ctx.has_bias,
                                   ctx.needs_input_grad[:3], ctx.x_shape, ctx.backend,
                                   ctx.store, ctx.params)
        return dx, dw, (db if need_b else None), None, None, None, None, None


class _ParallelMLP(torch.autograd.Function):
    """``fc2(gelu(fc1(x)))`` with the backward fused across the two GEMMs; see the module
    docstring."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w1, b1, w2, b2, plan1, plan2, sp, approximate, backend, keep):
        x = x.contiguous()
        x_full, y, pre = _fc1_forward(plan1, x, w1, b1, sp, approximate, backend, keep)
        h, n = w2.shape  # (hidden, ffn/tp)
        if plan2.tp == 1:  # the bias in the GEMM: one rounding in bf16/fp16, as F.linear
            z = cpu_gemm.mm_t(y.reshape(-1, n), w2, bias=b2).view(*y.shape[:-1], h)
            plan2.ran("forward", "none")
        elif sp:  # (b, s, N/tp) -> GEMM + reduce-scatter -> (b, s/tp, H)
            z, _ = plan2.run("forward", "reduce_scatter", y, _mm_t(w2), h)
        elif (deferred := deferring()) is not None:  # batch split: waited for later
            if b2 is not None:  # it would land on a partial sum still being reduced
                raise RuntimeError("a deferred all-reduce takes its bias later: pass b2=None "
                                   "and register it with add_bias_later")
            z = plan2.launch_deferred(y.reshape(-1, n), _mm_t(w2), y.shape[:-1], h, deferred)
        else:  # (M, N/tp) @ (N/tp, H) -> all-reduce -> (..., H)
            z, _ = plan2.run("forward", "all_reduce", y.reshape(-1, n), _mm_t(w2), h)
            z = z.view(*y.shape[:-1], h)
        if b2 is not None and plan2.tp > 1:  # after the reduction (at tp 1: in the GEMM)
            z = z.add_(b2)
        ctx.save_for_backward(x_full, w1, pre, y, w2)
        ctx.plans, ctx.sp, ctx.approximate, ctx.backend = (plan1, plan2), sp, approximate, backend
        ctx.has_b1, ctx.has_b2, ctx.x_shape = b1 is not None, b2 is not None, x.shape
        ctx.stores = weight_grad_store(w1), weight_grad_store(w2)
        ctx.params = (w1, trained(b1), w2)
        return z

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, gz):
        x_full, w1, pre, y, w2 = ctx.saved_tensors
        plan1, plan2 = ctx.plans
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_b1, need_b2 = need_b1 and ctx.has_b1, need_b2 and ctx.has_b2
        h, n = w2.shape
        gz = gz.contiguous()
        gb2, bias_work = None, None
        if need_b2:  # replicated bias: under sp each rank holds a partial sum
            gb2 = gz.reshape(-1, h).sum(0)
            if ctx.sp:
                bias_work = all_reduce(gb2, group=plan2.group, async_op=True)
        grads_into_fc1 = need_x or need_w1 or need_b1
        gu = db1 = None
        if ctx.sp:  # dZ (b, s/tp, H) -> all-gather, each chunk through the fused GEMM
            b = x_full.shape[0]
            pre4 = pre.view(b, plan2.tp, -1, n)
            chunks = _DgeluChunks(w2, pre4, need_b1, ctx.approximate, ctx.backend)
            (gz_full, gu), _ = plan2.run("backward", "all_gather", gz, chunks, n)
            gu = gu.reshape(-1, n)
            db1 = chunks.bias_grad()
            gz2 = gz_full.reshape(-1, h)
        else:
            plan2.ran("backward", "none")
            gz2 = gz.reshape(-1, h)
            if grads_into_fc1:  # (M, H) @ (H, N/tp), gelu'(pre) and db1 in the epilogue
                gu, db1 = torch.ops.distllm.gemm_dgelu(gz2, w2, pre.reshape(-1, n), need_b1,
                                                       ctx.approximate, ctx.backend)
                db1 = db1 if need_b1 else None
        gw2 = None
        if need_w2 and ctx.stores[1] is not None:  # zb-h1: left to W (the bias's stays here)
            ctx.stores[1].defer(ctx.params[2:], lambda: (gz2.t() @ y.reshape(-1, n),))
        elif need_w2:
            gw2 = gz2.t() @ y.reshape(-1, n)  # (H, M) @ (M, N/tp)
        dx = dw1 = None
        if grads_into_fc1:
            dx, dw1, db1 = _fc1_backward(plan1, ctx.sp, gu, db1, x_full, w1, ctx.has_b1,
                                         (need_x, need_w1, need_b1), ctx.x_shape, ctx.backend,
                                         ctx.stores[0], ctx.params[:2])
        if bias_work is not None:
            bias_work.wait()
        return (dx, dw1, (db1 if need_b1 else None), gw2, gb2,
                None, None, None, None, None, None)


def column_parallel_linear_gelu(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, plan: OverlapPlan,
                                sequence_parallel: bool, approximate: str,
                                backend: str) -> torch.Tensor:
    """Autograd entry of the fused column-parallel GEMM + bias + GeLU; ``backend`` already
    resolved (see :func:`resolve_backend`)."""
    keep = _needs_grad(x, weight, bias)
    return _ColumnParallelLinearGeLU.apply(x, weight, bias, plan, sequence_parallel,
                                           approximate, backend, keep)


def parallel_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, plan1: OverlapPlan, plan2: OverlapPlan,
                 sequence_parallel: bool, approximate: str, backend: str) -> torch.Tensor:
    """Autograd entry of the fused MLP (``plan1`` / ``plan2``: fc1's and fc2's overlap plans);
    ``backend`` already resolved (see :func:`resolve_backend`)."""
    keep = _needs_grad(x, w1, b1, w2, b2)
    if plan1.tp == 1 and torch.compiler.is_compiling():
        # a graph takes the registered fused op (its own autograd formula) and a linear:
        # this Function's saved views of its intermediates are not traceable
        for plan in (plan1, plan2):
            plan.ran("forward", "none")
        k, n = x.shape[-1], w1.shape[0]
        y, _ = torch.ops.distllm.linear_gelu_fwd(x.reshape(-1, k), w1, b1, approximate,
                                                 backend, keep)
        return F.linear(y.view(*x.shape[:-1], n), w2, b2)
    return _ParallelMLP.apply(x, w1, b1, w2, b2, plan1, plan2, sequence_parallel, approximate,
                              backend, keep)


class _SingleDevice:
    """The mesh of a layer on one device (tp=1: nothing communicates)."""

    tp, tp_rank, tp_group = 1, 0, None


def dense_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
              b2: torch.Tensor | None, approximate: str, backend: str,
              plans: tuple[OverlapPlan, OverlapPlan] | None = None) -> torch.Tensor:
    """``linear(gelu(linear(x, w1, b1)), w2, b2)`` on one device with the fused forward and
    the backward fused across the two GEMMs (:func:`parallel_mlp` at tp=1); ``backend``
    already resolved. ``plans``: where to record what ran (fresh ones if None)."""
    if plans is None:
        plans = single_device_plans("MLP")
    return parallel_mlp(x, w1, b1, w2, b2, plans[0], plans[1], False, approximate, backend)


def single_device_plans(name: str) -> tuple[OverlapPlan, OverlapPlan]:
    """The (fc1, fc2) overlap plans of an MLP on one device: records, no communication."""
    return (OverlapPlan(_SingleDevice(), "none", 1, f"{name}.fc1"),
            OverlapPlan(_SingleDevice(), "none", 1, f"{name}.fc2"))
