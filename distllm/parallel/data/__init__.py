"""Data parallelism: bucketed DDP and ZeRO-0/1/2/3 (see ``ddp.py`` and ``zero.py``)."""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "DistributedDataParallel": "distllm.parallel.data.ddp",
    "ZeroOptimizer": "distllm.parallel.data.zero",
    "memory_report": "distllm.parallel.data.memory",
    "MemoryReport": "distllm.parallel.data.memory",
    "zero_model_bytes": "distllm.parallel.data.memory",
    "clip_grad_norm_": "distllm.parallel.data.grad_norm",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
