"""The zero-bubble split of a chunk's backward into B (input gradients) and W (weight gradients).

During F of a split schedule, every ``torch.nn.functional.linear`` whose weight is a leaf that
requires grad (so every ``nn.Linear``) runs as :class:`_DeferredLinear`, whose backward returns
``dX = dY W`` and *records* ``(X, dY)`` instead of computing ``dW``. Then

- **B** is one ``torch.autograd.grad`` of the chunk output w.r.t. the stage input and all the
  chunk's parameters: it yields ``dX`` (sent upstream), the gradients of the parameters that
  are not deferred (norms, embeddings, biases of other ops, tensor-parallel layers' and
  fused GEMM + GeLU kernels, which compute their weight gradient inside their own
  backward), and the ``(X, dY)`` records of the deferred linears; the graph is freed here.
  The pipeline executor accumulates the non-deferred gradients on their leaves at once
  (``torch.autograd.backward(params, grads)``, under W's gradient-sync context), so that no
  copy of them waits for W; :class:`WeightGradStore` can also carry them to W
  (``params``, ``grads``);
- **W** computes the deferred ``dW = dY^T X`` and ``db = sum(dY)`` and accumulates them
  with one ``torch.autograd.backward(params, grads)`` on the leaves, so ``AccumulateGrad``
  runs and post-accumulate-grad hooks fire (DDP / ZeRO buckets are filled, not bypassed).

Only plain linears (``torch.nn.functional.linear``) defer: a tensor-parallel layer at
tp > 1 and the fused GEMM + GeLU compute their weight gradients in B, where their backward
overlaps its collective with that GEMM.

In float64 the result equals the plain backward to rounding (the same products, summed in
one GEMM instead of autograd's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["WeightGradStore", "DeferLinearWeightGrads"]


class WeightGradStore:
    """What B left for W of one (micro-batch, chunk)."""

    def __init__(self) -> None:
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]
        self.deferred = []  # (X, dY, weight, bias)
        self.params: list[torch.Tensor] = []  # other parameters' grads, computed in B
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def weight_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(params, grads)`` for W: the deferred GEMMs done now, plus B's other grads."""
        params, grads = list(self.params), list(self.grads)
        for x, g, w, b in self.deferred:
            g2 = g.reshape(-1, g.shape[-1])  # (tokens, out)
            params.append(w)
            grads.append(g2.t() @ x.reshape(-1, x.shape[-1]))  # (out, tokens) @ (tokens, in)
            if b is not None:
                params.append(b)
                grads.append(g2.sum(0))
        self.deferred.clear()
        return params, grads


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store: WeightGradStore):
        ctx.save_for_backward(x)
        # the parameters themselves (not saved-tensor copies): W accumulates into their .grad
        # a frozen bias (a leaf that needs no grad) gets no gradient from W
        train_bias = bias is not None and bias.requires_grad
        ctx.store, ctx.weight, ctx.bias = store, weight, bias if train_bias else None
        return F.linear(x, weight, bias)  # (..., in) @ (in, out) + (out,)

    @staticmethod
    def backward(ctx, g):
        (x,), w = ctx.saved_tensors, ctx.weight
        dx = g @ w if ctx.needs_input_grad[0] else None  # (..., out) @ (out, in)
        ctx.store.deferred.append((x, g, w, ctx.bias))
        return dx, None, None, None


class DeferLinearWeightGrads(TorchFunctionMode):
    """Inside it, linears with a leaf weight that requires grad record their weight gradient
    (and their bias's, where it requires grad) into ``store``."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.is_leaf and w.requires_grad and (b is None or b.is_leaf):
                return _DeferredLinear.apply(x, w, b, self.store)
        return func(*args, **kwargs)
