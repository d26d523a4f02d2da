"""Collectives and the engines that overlap them with computation.

- :mod:`distllm.comm.overlap`: chunked GEMM + all-reduce, all-gather + GEMM and
  GEMM + reduce-scatter (tensor and sequence parallelism), with per-layer
  :class:`~distllm.comm.overlap.OverlapStats`;
- :mod:`distllm.comm.autotune`: ``overlap="auto"``'s cached measurement.

Names are imported lazily from the module that defines them.
"""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "CommContext": "distllm.comm.overlap",
    "OverlapStats": "distllm.comm.overlap",
    "OverlapCounter": "distllm.comm.overlap",
    "matmul_all_reduce": "distllm.comm.overlap",
    "allgather_matmul": "distllm.comm.overlap",
    "matmul_reduce_scatter": "distllm.comm.overlap",
    "pipeline_bounds": "distllm.comm.overlap",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
