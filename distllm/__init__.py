"""distllm: distributed LLM training whose kernels fuse computation with communication.

Public entry points: :class:`ParallelDims` (the mesh), ``distllm.ops`` (fused ops),
``distllm.nn`` (drop-in fused and parallel layers), ``distllm.parallel`` (DDP, ZeRO,
pipeline), ``distllm.models``, ``distllm.train``, ``distllm.plan``; the ``distllm`` command.
Compiled extensions load lazily: ``import distllm`` never needs them.
"""

from __future__ import annotations

import importlib
import logging

from distllm.parallel.mesh import ParallelDims

__version__ = "0.1.0"
__all__ = ["ParallelDims", "__version__"]

logging.getLogger("distllm").addHandler(logging.NullHandler())

_SUBMODULES = {"ops", "nn", "parallel", "comm", "models", "train", "plan", "kernels", "bench",
               "testing"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"distllm.{name}")
    raise AttributeError(f"module 'distllm' has no attribute {name!r}")
