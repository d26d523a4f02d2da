"""Drop-in modules users build models from: fused layers and tensor-parallel layers.

- ``fused``: :class:`FusedLinearGeLU` and :func:`fuse` (Linear -> GeLU pairs of an existing
  model, read from each block's ``torch.fx`` graph, swapped in place);
- ``parallel_linear``: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`;
- ``embedding``: :class:`VocabParallelEmbedding`; ``cross_entropy``:
  :func:`vocab_parallel_cross_entropy` (never gathers the full logits);
- ``mlp``: :class:`ParallelMLP`; ``attention``: :class:`ParallelAttention`;
- ``layernorm``: :class:`ParallelLayerNorm`.

Their collectives and GEMM-with-communication functions live in
:mod:`distllm.parallel.tensor`.
"""

from __future__ import annotations

from distllm.nn.attention import ParallelAttention
from distllm.nn.cross_entropy import vocab_parallel_cross_entropy
from distllm.nn.embedding import VocabParallelEmbedding
from distllm.nn.fused import FusedLinearGeLU, fuse
from distllm.nn.layernorm import ParallelLayerNorm
from distllm.nn.mlp import ParallelMLP
from distllm.nn.parallel_linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "FusedLinearGeLU",
    "fuse",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "ParallelMLP",
    "ParallelAttention",
    "ParallelLayerNorm",
]
