"""``ParallelLayerNorm``: a LayerNorm whose replicated parameters stay correct in
sequence-parallel regions.

With ``sequence_parallel=True`` each tp rank normalises only its sequence shard, so its
weight/bias gradients are partial sums: forward has no collective, backward all-reduces
the weight and bias gradients over tp (inside the module, via ``sync_grad_over_tp``), so
every rank's ``.grad`` is the full gradient. Without sequence parallelism the input is
replicated over tp and no collective runs in either direction.
"""

from __future__ import annotations

import torch
from torch import nn

from distllm.nn.precision import layer_norm
from distllm.parallel.tensor.mappings import sync_grad_over_tp
from distllm.parallel.tensor.sharding import mark_sequence_parallel

torch.fx.wrap("layer_norm")  # recorded as one call by torch.fx (see distllm.nn.precision)

__all__ = ["ParallelLayerNorm"]


class ParallelLayerNorm(nn.Module):
    """LayerNorm over the last dim (``hidden``); parameters replicated over tp.

    Collectives: forward none; backward none, or (``sequence_parallel``) an all-reduce of
    the weight and bias gradients over tp. The parameters carry ``sequence_parallel = True``
    then, as a marker only (their gradients are already complete).
    """

    def __init__(self, hidden: int, dims, eps: float = 1e-5, sequence_parallel: bool = False,
                 bias: bool = True, dtype=None, device=None):
        super().__init__()
        self.hidden, self.eps, self.dims = hidden, eps, dims
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)) if bias else None
        if self.sequence_parallel:
            for p in self.parameters():
                mark_sequence_parallel(p)

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, dims, sequence_parallel: bool = False
                   ) -> ParallelLayerNorm:
        """Copy a dense ``nn.LayerNorm`` (1-D ``normalized_shape``, affine)."""
        if len(ln.normalized_shape) != 1 or ln.weight is None:
            raise ValueError("ParallelLayerNorm.from_dense needs an affine LayerNorm over the "
                             f"last dim only, got normalized_shape={ln.normalized_shape}")
        m = cls(ln.normalized_shape[0], dims, eps=ln.eps, sequence_parallel=sequence_parallel,
                bias=ln.bias is not None, dtype=ln.weight.dtype, device=ln.weight.device)
        with torch.no_grad():
            m.weight.copy_(ln.weight)
            if m.bias is not None:
                m.bias.copy_(ln.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = sync_grad_over_tp(w, self.dims.tp_group)
            b = None if b is None else sync_grad_over_tp(b, self.dims.tp_group)
        return layer_norm(x, (self.hidden,), w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, sp={self.sequence_parallel}"
