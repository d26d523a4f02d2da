"""Tensor parallelism (Megatron-style), all of it in this folder:

- :mod:`~distllm.parallel.tensor.mappings`: the collectives as autograd Functions (the f/g
  operators, scatter/gather of the last dim, the sequence-parallel all-gather /
  reduce-scatter pairs), tiered as primitives, then autograd Functions, then wrappers;
- :mod:`~distllm.parallel.tensor.layers`: the column- and row-parallel GEMMs with their
  communication, the layer's :class:`OverlapPlan` and the :class:`OverlapStats` it records
  (including which collective ran);
- :mod:`~distllm.parallel.tensor.overlap`: the overlap engines (chunked GEMM + all-reduce,
  all-gather + GEMM, GEMM + reduce-scatter) and the :class:`CommContext` that runs their
  collectives asynchronously;
- :mod:`~distllm.parallel.tensor.overlap_tuner`: ``overlap="auto"``'s cached measurement
  and, on CPU, its trial in the step (:func:`settle_overlap` runs a step until it is over);
- :mod:`~distllm.parallel.tensor.sharding`: initialising, sharding and marking parameters.

The modules users build models from (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ...) live in :mod:`distllm.nn`; collectives every parallelism
shares (the gloo reduce-scatter) in :mod:`distllm.comm`.
"""

from distllm.parallel.tensor.layers import (
    OVERLAP_MODES,
    OverlapCounter,
    OverlapPlan,
    OverlapStats,
    column_parallel_matmul,
    overlap_plans,
    overlap_tuning,
    row_parallel_matmul,
    settle_overlap,
)
from distllm.parallel.tensor.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sync_grad_over_tp,
)
from distllm.parallel.tensor.overlap import CommContext
from distllm.parallel.tensor.sharding import (
    mark_sequence_parallel,
    mark_tensor_parallel,
    shard,
)

__all__ = [
    "OVERLAP_MODES", "OverlapCounter", "OverlapPlan", "OverlapStats", "CommContext",
    "column_parallel_matmul", "row_parallel_matmul", "overlap_plans", "overlap_tuning",
    "settle_overlap",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
    "gather_from_tp_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel",
    "sync_grad_over_tp", "mark_tensor_parallel", "mark_sequence_parallel", "shard",
]
