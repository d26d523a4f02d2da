"""Drop-in modules: fused layers and tensor-parallel layers.

Names are imported lazily from the module that defines them.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distllm.nn' has no attribute {name!r}")
