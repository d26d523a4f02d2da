"""Tensor parallelism (Megatron-style): ``tp_comm`` holds the collectives as autograd
Functions (the f/g operators, the sequence-parallel all-gather / reduce-scatter),
``tensor_parallel`` the sharding helpers and the overlapped column/row-parallel GEMMs.
The modules users build models from live in :mod:`distllm.nn`."""

from distllm.parallel.tensor.tensor_parallel import (
    OverlapPlan,
    column_parallel_matmul,
    mark_tensor_parallel,
    row_parallel_matmul,
)
from distllm.parallel.tensor.tp_comm import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sync_grad_over_tp,
)

__all__ = [
    "OverlapPlan", "column_parallel_matmul", "row_parallel_matmul", "mark_tensor_parallel",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
    "gather_from_tp_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel",
    "sync_grad_over_tp",
]
