"""distllm: distributed LLM training whose kernels fuse computation with communication.

Public entry points: :class:`ParallelDims` (the mesh), ``distllm.ops`` (fused ops),
``distllm.nn`` (drop-in fused and parallel layers), ``distllm.parallel`` (DDP, ZeRO,
pipeline), ``distllm.models``, ``distllm.train``, ``distllm.plan``, ``distllm.diagnostics``
(the overlap doctor); the ``distllm`` command. These are imported here, plainly.

Imported only when asked for: ``distllm.kernels`` (Triton), ``distllm.bench`` (the
benchmark suite, which the library never imports) and ``distllm.testing``. The compiled
extensions (``distllm._C``, ``distllm._cuda``) load on first use: ``import distllm`` never
needs them.
"""

from __future__ import annotations

import logging

from distllm import comm, diagnostics, models, nn, ops, parallel, plan, train
from distllm.parallel.mesh import ParallelDims

__version__ = "0.1.0"
__all__ = [
    "ParallelDims",
    "__version__",
    "comm",
    "diagnostics",
    "models",
    "nn",
    "ops",
    "parallel",
    "plan",
    "train",
]

logging.getLogger("distllm").addHandler(logging.NullHandler())
