"""Drop-in modules: fused layers and tensor-parallel layers.

Names are imported lazily from the module that defines them.
"""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "FusedLinearGeLU": "distllm.nn.fused",
    "fuse": "distllm.nn.fused",
    "ColumnParallelLinear": "distllm.nn.parallel_linear",
    "RowParallelLinear": "distllm.nn.parallel_linear",
    "VocabParallelEmbedding": "distllm.nn.embedding",
    "vocab_parallel_cross_entropy": "distllm.nn.cross_entropy",
    "ParallelMLP": "distllm.nn.mlp",
    "ParallelAttention": "distllm.nn.attention",
    "ParallelLayerNorm": "distllm.nn.layernorm",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
