"""The zero-bubble split of a backward into B (input gradients) and W (weight gradients).

Under :class:`DeferLinearWeightGrads` (a pipeline chunk's forward in a split schedule), every
layer whose weight-gradient GEMM can wait leaves it to W:

- ``torch.nn.functional.linear`` (so every ``nn.Linear``) with a leaf weight that requires
  grad runs as :class:`_DeferredLinear`, whose backward returns ``dX = dY W`` and records
  ``dW = dY^T X`` (and ``db = sum(dY)``) for W;
- the fused GEMM + GeLU op (:mod:`distllm.ops.linear_gelu`), the tensor-parallel layers
  (:mod:`distllm.parallel.tensor.layers`) and the fused column-parallel GEMM + GeLU and MLP
  (:mod:`distllm.parallel.tensor.fused_mlp`) ask :func:`weight_grad_store` in their
  forward; their backward then runs the input-gradient GEMM with its collective (all-reduce,
  reduce-scatter or all-gather) and records the weight-gradient GEMM, with the bias's where
  that needs no collective and no kernel of B computed it (a row-parallel bias, all-reduced
  under sequence parallelism, and a bias sum fused into B's kernel stay in B).

Then

- **B** is one ``torch.autograd.grad`` of the chunk output w.r.t. the stage input and all the
  chunk's parameters: it yields ``dX`` (sent upstream), the gradients of the parameters that
  are not deferred (norms, embeddings, the biases above), and the records of the deferred
  GEMMs; the graph is freed here. The pipeline executor accumulates the non-deferred
  gradients on their leaves at once (``torch.autograd.backward(params, grads)``, under W's
  gradient-sync context), so that no copy of them waits for W; :class:`WeightGradStore` can
  also carry them to W (``params``, ``grads``);
- **W** (:meth:`WeightGradStore.accumulate`) runs the deferred GEMMs one layer at a time,
  each accumulated at once with ``torch.autograd.backward(params, grads)`` on the leaves, so
  ``AccumulateGrad`` runs and post-accumulate-grad hooks fire (DDP / ZeRO buckets are
  filled, not bypassed), and each layer's record freed.

A tensor-parallel backward whose weight GEMM is deferred runs its collective alone (it
overlaps it with that GEMM otherwise): B gets shorter, and W, which has no collective,
fills the pipeline's bubbles (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

In float64 the result equals the plain backward to rounding (the same products).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distllm.dtypes import autocast_cast

__all__ = ["WeightGradStore", "DeferLinearWeightGrads", "weight_grad_store", "leave_to_w", "paused",
           "trained"]

Grads = Callable[[], Sequence[torch.Tensor | None]]


class WeightGradStore:
    """What B left for W of one (micro-batch, chunk)."""

    def __init__(self) -> None:
        # (parameters, the function giving their gradients in order); None: no gradient
        self.deferred: deque[tuple[tuple[torch.Tensor | None, ...], Grads]] = deque()
        self.params: list[torch.Tensor] = []  # other parameters' grads, computed in B
        self.grads: list[torch.Tensor] = []

    def defer(self, params: Sequence[torch.Tensor | None], grads: Grads) -> None:
        """Leave to W the gradients of ``params`` (leaves; None entries get none), which
        ``grads()`` computes, in the same order, from what it holds."""
        self.deferred.append((tuple(params), grads))

    def deferred_params(self) -> set[int]:
        """``id`` of every parameter with a deferred gradient (B leaves the rest of such a
        parameter's gradient here, in ``params`` / ``grads``, for W to sum)."""
        return {id(p) for ps, _ in self.deferred for p in ps if p is not None}

    def accumulate(self) -> None:
        """W: each deferred GEMM in turn, its result accumulated on the leaves at once
        (``torch.autograd.backward``, so hooks fire) and its record dropped: W holds one
        layer's weight gradient at a time and frees each layer's ``X`` and ``dY`` as it goes,
        not the chunk's all together. A parameter with several parts (a layer called twice,
        or a part B left in ``params``) is summed until its last and accumulated once, so
        that its post-accumulate hook fires once, as in a plain backward."""
        left = Counter(id(p) for ps, _ in self.deferred for p in ps if p is not None)
        partial: dict[int, torch.Tensor] = {}

        def take(pairs) -> None:  # sum each parameter's parts; accumulate the complete ones
            ready = []
            for p, g in pairs:
                if p is None:
                    continue
                if g.dtype != p.dtype:  # an autocast GEMM's gradient of a wider weight
                    g = g.to(p.dtype)
                if id(p) in partial:
                    g = partial.pop(id(p)) + g
                left[id(p)] -= 1
                if left[id(p)] > 0:
                    partial[id(p)] = g
                else:
                    ready.append((p, g))
            if ready:
                torch.autograd.backward([p for p, _ in ready], [g for _, g in ready])

        params, grads, self.params, self.grads = self.params, self.grads, [], []
        left.update(id(p) for p in params)
        take(zip(params, grads, strict=True))
        del params, grads
        while self.deferred:
            ps, fn = self.deferred.popleft()
            with torch.no_grad():
                gs = fn()
            del fn
            take(zip(ps, gs, strict=True))
            del gs


class _Active(threading.local):
    """Per thread, as torch's function modes are: the stores of the entered
    :class:`DeferLinearWeightGrads` and :func:`paused` (None), innermost last."""

    def __init__(self) -> None:
        self.stack: list[WeightGradStore | None] = []


_ACTIVE = _Active()


def weight_grad_store(weight: torch.Tensor) -> WeightGradStore | None:
    """For an autograd Function's forward: the store its backward leaves ``weight``'s
    gradient GEMM to, or None (compute it in the backward). A store only inside
    :class:`DeferLinearWeightGrads` (and not :func:`paused`), for a leaf weight that requires
    grad (not autocast's copy); the backward defers only where it computes that gradient."""
    if not _ACTIVE.stack or not (weight.is_leaf and weight.requires_grad):
        return None
    return _ACTIVE.stack[-1]


@contextlib.contextmanager
def paused():
    """Inside it nothing defers, even within :class:`DeferLinearWeightGrads`: for work that
    is not the step's (a backend's timing runs on copies of the weights)."""
    _ACTIVE.stack.append(None)
    try:
        yield
    finally:
        _ACTIVE.stack.pop()


def leave_to_w(store: WeightGradStore, weight: torch.Tensor, bias: torch.Tensor | None,
               need_b: bool, grads: Callable[[bool], Sequence[torch.Tensor | None]]) -> bool:
    """Record for W the gradient of ``weight`` and, where ``need_b`` and ``bias`` is a leaf
    (:func:`trained`), of ``bias``: ``grads(with_bias)`` gives ``(dW, db or None)``. Returns
    whether the bias's went to W (False: B computes it, e.g. for a cast bias)."""
    b_later = need_b and bias is not None
    store.defer((weight, bias if b_later else None), lambda: grads(b_later))
    return b_later


def trained(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` where it is a leaf that requires grad (a bias W accumulates into), else None."""
    return t if t is not None and t.is_leaf and t.requires_grad else None


def _linear_grads(x: torch.Tensor, g: torch.Tensor, bias: bool) -> Grads:
    def grads():
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, out)
        return g2.t() @ x.reshape(-1, x.shape[-1]), (g2.sum(0) if bias else None)
    return grads


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store: WeightGradStore):
        dev = x.device.type
        cast = torch.is_autocast_enabled(dev)
        if cast:  # as autocast runs F.linear: in its dtype (the weight's gradient is cast back)
            dt = torch.get_autocast_dtype(dev)
            x, w, b = (autocast_cast(t, dev, dt) for t in (x, weight, bias))
        else:
            w, b = weight, bias
        ctx.save_for_backward(x, w if cast else None)
        # the parameters themselves (not saved-tensor copies): W accumulates into their .grad
        # a frozen bias (a leaf that needs no grad) gets no gradient from W
        ctx.store, ctx.weight, ctx.bias = store, weight, trained(bias)
        with torch.autocast(dev, enabled=False):
            return F.linear(x, w, b)  # (..., in) @ (in, out) + (out,)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w = ctx.weight if w is None else w  # autocast's copy, or the parameter
        dx = g @ w if ctx.needs_input_grad[0] else None  # (..., out) @ (out, in)
        ctx.store.defer((ctx.weight, ctx.bias), _linear_grads(x, g, ctx.bias is not None))
        return dx, None, None, None


class DeferLinearWeightGrads(TorchFunctionMode):
    """Inside it, linears with a leaf weight that requires grad record their weight gradient
    (and their bias's, where it requires grad) into ``store``; so do the tensor-parallel and
    fused layers (:func:`weight_grad_store`)."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __enter__(self):
        out = super().__enter__()
        _ACTIVE.stack.append(self.store)  # (a store of its own: ``is`` tells it from a paused one)
        return out

    def __exit__(self, *exc):
        _ACTIVE.stack.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled() and _ACTIVE.stack[-1] is self.store:
            x = args[0] if args else kwargs["input"]  # F.linear(input, weight, bias=None)
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.is_leaf and w.requires_grad and (b is None or b.is_leaf):
                return _DeferredLinear.apply(x, w, b, self.store)
        return func(*args, **kwargs)
