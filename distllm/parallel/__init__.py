"""Parallelism: the mesh, tensor (``tensor/``), pipeline (``pipeline/``) and data (``data/``).

``mesh.ParallelDims`` validates the sizes at construction and builds the process groups in a
separate step (``build()``, done at once when no ``world_size`` is given).
``DistributedDataParallel``, ``ZeroOptimizer`` and ``memory_report`` come from ``data``.
"""

from __future__ import annotations

from distllm.parallel import data, pipeline, tensor
from distllm.parallel.data import DistributedDataParallel, ZeroOptimizer, memory_report
from distllm.parallel.mesh import ParallelDims

__all__ = [
    "ParallelDims",
    "DistributedDataParallel",
    "ZeroOptimizer",
    "memory_report",
    "pipeline",
    "tensor",
    "data",
]
