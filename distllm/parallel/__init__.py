"""Parallelism: the mesh, tensor (``tensor/``), pipeline (``pipeline/``) and data (``data/``).

``mesh.ParallelDims`` validates the sizes at construction and builds the process groups in a
separate step (``build()``, done at once when no ``world_size`` is given).

Names are imported lazily so that each part loads only when used.
"""

from __future__ import annotations

from distllm._lazy import lazy_exports
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


__getattr__ = lazy_exports(__name__, _LAZY)
