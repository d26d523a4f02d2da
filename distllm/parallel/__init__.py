"""Parallelism: the mesh, tensor (``tensor/``), pipeline (``pipeline/``) and data (``data/``).

Names are imported lazily so that each part loads only when used.
"""

from __future__ import annotations

import importlib

from distllm.parallel.mesh import ParallelDims

_LAZY = {
    "DistributedDataParallel": "distllm.parallel.data.ddp",
    "ZeroOptimizer": "distllm.parallel.data.zero",
    "memory_report": "distllm.parallel.data.memory",
    "pipeline": "distllm.parallel.pipeline",
    "tensor": "distllm.parallel.tensor",
    "data": "distllm.parallel.data",
}

__all__ = ["ParallelDims", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        return mod if mod.__name__.endswith(name) else getattr(mod, name)
    raise AttributeError(f"module 'distllm.parallel' has no attribute {name!r}")
