"""``VocabParallelEmbedding``: the embedding table split over tp along the vocabulary."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distllm.parallel.tensor.mappings import (
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel,
)
from distllm.parallel.tensor.sharding import mark_tensor_parallel, shard

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)`` of the ``(vocab, hidden)`` table; a token
    outside its range contributes zeros, and the ranks' partial outputs are summed.

    Collectives: forward all-reduce of the ``(batch, seq, hidden)`` output over tp
    (``sequence_parallel``: reduce-scatter along the sequence, leaving ``(batch, seq/tp,
    hidden)``); backward none (``sequence_parallel``: all-gather of the gradient along the
    sequence). Default init: N(0, 1), as ``nn.Embedding``, drawn on the full table so it
    does not depend on tp.
    """

    def __init__(self, vocab: int, hidden: int, dims, sequence_parallel: bool = False,
                 dtype=None, device=None,
                 init_method: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        if vocab % dims.tp:
            pad = -vocab % dims.tp
            raise ValueError(f"vocab={vocab} is not divisible by tp={dims.tp}: pad the vocabulary "
                             f"to {vocab + pad} (a multiple of tp) or choose another tp")
        self.vocab, self.hidden, self.dims = vocab, hidden, dims
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.per_rank = vocab // dims.tp
        self.start = dims.tp_rank * self.per_rank
        full = torch.empty(vocab, hidden, dtype=dtype, device=device)
        (init_method or nn.init.normal_)(full)
        self.weight = mark_tensor_parallel(nn.Parameter(shard(full, 0, dims.tp_rank, dims.tp)), 0)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, dims, sequence_parallel: bool = False
                   ) -> VocabParallelEmbedding:
        """Shard a dense ``nn.Embedding``'s rows."""
        m = cls(emb.num_embeddings, emb.embedding_dim, dims, sequence_parallel=sequence_parallel,
                dtype=emb.weight.dtype, device=emb.weight.device)
        with torch.no_grad():
            m.weight.copy_(shard(emb.weight, 0, dims.tp_rank, dims.tp))
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp, group = self.dims.tp, self.dims.tp_group
        if tp == 1:
            return F.embedding(ids, self.weight)
        if self.sequence_parallel and (ids.dim() != 2 or ids.shape[1] % tp):
            raise ValueError(f"VocabParallelEmbedding: ids of shape {tuple(ids.shape)}: under "
                             f"sequence_parallel=True they must be (batch, seq) with seq a "
                             f"multiple of tp={tp}")
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, group)
        return reduce_from_tp_region(out, group)

    def extra_repr(self) -> str:
        return f"{self.vocab}/tp={self.dims.tp}, {self.hidden}, sp={self.sequence_parallel}"
