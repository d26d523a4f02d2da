"""Bytes per rank of parameters, gradients and optimizer states, measured from the tensors
actually held (each storage counted once), and the ZeRO paper's model to compare with.
"""

from __future__ import annotations

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


def _bytes(tensors, seen: set) -> int:
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
    ``optimizer`` to count the optimizer state)."""
    from distllm.parallel.data.zero import ZeroOptimizer

    seen: set = set()
    if isinstance(obj, ZeroOptimizer):
        return _zero_report(obj, seen)
    module: nn.Module = obj
    params = _bytes(module.parameters(), seen)
    reducer = getattr(obj, "reducer", None)
    bufs = [b.buffer for b in reducer.buckets] if reducer is not None else []
    grads = _bytes(bufs + [p.grad for p in module.parameters()], seen)
    opt = _bytes(_optimizer_tensors(optimizer), seen) if optimizer is not None else 0
    return MemoryReport(params, grads, opt)


def _zero_report(z, seen: set) -> MemoryReport:
    if z.sharded is not None:
        shards = [f.shard for fl in z.sharded.flats.values() for f in fl]
        fulls = [f.full for fl in z.sharded.flats.values() for f in fl]
        params = _bytes(shards + fulls, seen)
    else:
        params = _bytes([f for f in z.flat if f is not None], seen)
    grads = _bytes([b.buffer for b in z.reducer.buckets] + [b.shard for b in z.reducer.buckets]
                   + [p.grad for p in z.reducer.params()] + [m.grad for m in z.masters], seen)
    masters = _bytes(z.masters, seen)  # nothing new when the masters alias the parameters
    opt = _bytes(_optimizer_tensors(z.optimizer), seen)
    return MemoryReport(params, grads, masters + opt)


def zero_model_bytes(psi: int, n: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                     optim_bytes: int = 12) -> int:
    """The ZeRO paper's per-rank bytes: ``(P + G + K)Ψ`` for stage 0, ``(P + G)Ψ + KΨ/N``,
    ``PΨ + (G + K)Ψ/N``, ``(P + G + K)Ψ/N`` for stages 1, 2, 3 (defaults: mixed precision
    Adam, P = G = 2, K = 12, giving 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N)."""
    p, g, k = param_bytes * psi, grad_bytes * psi, optim_bytes * psi
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
