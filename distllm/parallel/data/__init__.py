"""Data parallelism: bucketed DDP and ZeRO-0/1/2/3 (see ``ddp.py`` and ``zero.py``)."""

from __future__ import annotations

import importlib

_LAZY = {
    "DistributedDataParallel": "distllm.parallel.data.ddp",
    "ZeroOptimizer": "distllm.parallel.data.zero",
    "memory_report": "distllm.parallel.data.memory",
    "MemoryReport": "distllm.parallel.data.memory",
    "zero_model_bytes": "distllm.parallel.data.memory",
    "clip_grad_norm_": "distllm.parallel.data.grad_norm",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distllm.parallel.data' has no attribute {name!r}")
