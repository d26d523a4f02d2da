"""Training: config dataclasses, data, the engine (TP x PP x DP/ZeRO), loop and checkpoints.

``distllm train`` (:mod:`distllm.train.cli`) is a thin layer over :func:`train`.
"""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "train": "distllm.train.trainer",
    "TrainConfig": "distllm.train.config",
    "ParallelConfig": "distllm.train.config",
    "OptimConfig": "distllm.train.config",
    "Engine": "distllm.train.engine",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
