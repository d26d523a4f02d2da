"""Training: config dataclasses, data, the engine (TP x PP x DP/ZeRO), loop and checkpoints.

``distllm train`` (:mod:`distllm.train.cli`) is a thin layer over :func:`train`.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "train": "distllm.train.trainer",
    "TrainConfig": "distllm.train.config",
    "ParallelConfig": "distllm.train.config",
    "OptimConfig": "distllm.train.config",
    "Engine": "distllm.train.engine",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distllm.train' has no attribute {name!r}")
