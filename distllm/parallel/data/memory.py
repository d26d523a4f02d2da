"""Bytes per rank of parameters, gradients and optimizer states, measured from the tensors
actually held (each storage counted once), and the ZeRO paper's model to compare with.

A wrapper reports what it holds through a ``held_tensors()`` method (``{"params": [...],
"grads": [...], "optimizer": [...]}``, as :class:`~distllm.parallel.ZeroOptimizer` and
:class:`~distllm.parallel.DistributedDataParallel` define it); a plain module is measured
from its parameters and their ``.grad``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MemoryReport", "memory_report", "zero_model_bytes"]


@dataclass
class MemoryReport:
    """Bytes held by this rank.

    ``params``: compute parameters (stage 3: the shards plus any layer gathered right now);
    ``grads``: gradient storage kept for the optimizer (buckets, or shards for stage 2/3,
    plus any transient bucket alive); ``optimizer``: fp32 master weights (when distinct from
    the parameters) and optimizer state.
    """

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _bytes(tensors: Iterable[Any], seen: set) -> int:
    n = 0
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        n += st.nbytes()
    return n


def _optimizer_tensors(opt: torch.optim.Optimizer):
    for s in opt.state.values():
        yield from (v for v in s.values() if isinstance(v, Tensor))


def memory_report(obj: Any, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Measure a :class:`~distllm.parallel.ZeroOptimizer`, a
    :class:`~distllm.parallel.DistributedDataParallel` or a plain module (pass its
    ``optimizer`` to count the optimizer state). Kinds are counted in the order params,
    grads, optimizer, so a storage shared by two kinds counts in the first."""
    if hasattr(obj, "held_tensors"):
        held = obj.held_tensors()
    else:
        module: nn.Module = obj
        held = {"params": list(module.parameters()),
                "grads": [p.grad for p in module.parameters()]}
    if optimizer is not None:
        held.setdefault("optimizer", []).extend(_optimizer_tensors(optimizer))
    seen: set = set()
    return MemoryReport(*(_bytes(held.get(k, ()), seen) for k in ("params", "grads", "optimizer")))


def zero_model_bytes(psi: int, n: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                     optim_bytes: int = 12) -> int:
    """The ZeRO paper's per-rank bytes: ``(P + G + K)Ψ`` for stage 0, ``(P + G)Ψ + KΨ/N``,
    ``PΨ + (G + K)Ψ/N``, ``(P + G + K)Ψ/N`` for stages 1, 2, 3 (defaults: mixed precision
    Adam, P = G = 2, K = 12, giving 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N)."""
    p, g, k = param_bytes * psi, grad_bytes * psi, optim_bytes * psi
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
