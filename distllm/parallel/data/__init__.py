"""Data parallelism: bucketed DDP and ZeRO-0/1/2/3, in one folder.

- ``buckets.py``: flat gradient buckets whose all-reduce / reduce-scatter overlaps backward;
- ``replicas.py``: the DP group of a mesh, the broadcast that makes replicas equal;
- ``ddp.py``: :class:`DistributedDataParallel` (buckets all-reduced);
- ``zero.py``: :class:`ZeroOptimizer`, stages 0-3, with its parts ``zero_setup.py``
  (arguments, flat buffers), ``zero3.py`` (stage-3 parameter shards gathered per layer),
  ``zero_gather.py`` (stage-1/2 parameter all-gathers), ``zero_state.py`` (full-tensor
  checkpoints, module state-dict hooks) and ``loss_scale.py``;
- ``grad_norm.py``: :func:`clip_grad_norm_` over DP shards, TP and PP;
- ``memory.py``: :func:`memory_report`, bytes held per rank against the ZeRO paper's model.

Collectives come from :mod:`distllm.comm` (the gloo reduce-scatter, the broadcast, the
torch-version compatibility point).
"""

from __future__ import annotations

from distllm.parallel.data.ddp import DistributedDataParallel
from distllm.parallel.data.grad_norm import clip_grad_norm_
from distllm.parallel.data.memory import MemoryReport, memory_report, zero_model_bytes
from distllm.parallel.data.zero import ZeroOptimizer

__all__ = [
    "DistributedDataParallel",
    "ZeroOptimizer",
    "memory_report",
    "MemoryReport",
    "zero_model_bytes",
    "clip_grad_norm_",
]
