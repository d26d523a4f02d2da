"""LayerNorm and embedding lookups whose weight gradients are summed in fp32 on the CPU.

PyTorch's CPU backward kernels of ``F.layer_norm`` and ``F.embedding`` sum the weight (and
bias) gradients over the tokens in the parameter's dtype. With bf16 parameters that sum is
taken in bf16 (8 mantissa bits). At 4096 tokens (the tiny GPT's default micro-batch on one
rank), hidden 64 and 256 rows, against float64 (the largest error over the largest entry):
the LayerNorm weight and bias gradients 6.5% and 7.2% off, the table's 1.1%; through these
functions 0.32%, 0.24% and 0.29% (``tests/nn/test_precision.py``). Their CUDA kernels
accumulate in fp32, so these functions change nothing there:

- :func:`layer_norm`: on the CPU, bf16/fp16 inputs are normalised in fp32 (input, weight
  and bias upcast; the output cast back), so the weight gradients are fp32 sums rounded
  once;
- :func:`embedding`: on the CPU, a bf16/fp16 table's gradient is summed into an fp32 table
  (``aten.embedding_dense_backward`` on the fp32 output gradient) and rounded once.

:class:`LayerNorm` and :class:`Embedding` are ``nn.LayerNorm`` and ``nn.Embedding`` with
these forwards (same parameters, state-dict keys and ``isinstance``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["layer_norm", "embedding", "LayerNorm", "Embedding"]

_LOW = (torch.bfloat16, torch.float16)


def _low_on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _LOW


def layer_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm``; bf16/fp16 on the CPU computed in fp32 (see the module)."""
    if not _low_on_cpu(x):
        return F.layer_norm(x, shape, weight, bias, eps)
    up = [None if t is None else t.float() for t in (weight, bias)]
    return F.layer_norm(x.float(), shape, up[0], up[1], eps).to(x.dtype)


class _EmbeddingFP32Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.dtype = weight.shape[0], weight.dtype
        ctx.pad = -1 if padding_idx is None else padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        g = torch.ops.aten.embedding_dense_backward(grad.float(), ids, ctx.rows, ctx.pad, False)
        return None, g.to(ctx.dtype), None


def embedding(ids: torch.Tensor, weight: torch.Tensor,
              padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding``; a bf16/fp16 table on the CPU gets its gradient summed in fp32."""
    if _low_on_cpu(weight) and weight.requires_grad and torch.is_grad_enabled():
        return _EmbeddingFP32Grad.apply(ids, weight, padding_idx)
    return F.embedding(ids, weight, padding_idx)


# torch.fx records the two as calls (their device test is not traceable), as it records
# F.layer_norm and F.embedding; each module that calls them by name wraps them too
torch.fx.wrap("layer_norm")
torch.fx.wrap("embedding")


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` through :func:`layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (no ``max_norm``, no sparse gradient) through :func:`embedding`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None or self.sparse or self.scale_grad_by_freq:
            return super().forward(ids)
        return embedding(ids, self.weight, self.padding_idx)
