"""``VocabParallelEmbedding``: the embedding table split over tp along the vocabulary."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from distllm.nn.precision import embedding
from distllm.parallel.tensor.mappings import (
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel,
)
from distllm.parallel.tensor.sharding import mark_tensor_parallel, shard

torch.fx.wrap("embedding")  # recorded as one call by torch.fx (see distllm.nn.precision)

__all__ = ["VocabParallelEmbedding", "check_ids_in_vocab"]


def check_ids_in_vocab(ids: torch.Tensor, vocab: int, what: str,
                       ignore_index: int | None = None) -> None:
    """Raise a ValueError naming the vocabulary size if an id of ``ids`` (other than
    ``ignore_index``) is outside ``[0, vocab)``. The check is ``torch._assert_async``: on an
    accelerator (and while compiling) a device-side assert, queued without a host sync; on
    CPU it fails at once, and the failure becomes the ValueError. Fake tensors carry no
    values and pass."""
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    also = f", or equal ignore_index={ignore_index}" if ignore_index is not None else ""
    msg = f"{what} must be in [0, {vocab}) for a vocabulary of size {vocab}{also}"
    ok = bad.any().logical_not()
    if torch.compiler.is_compiling() or ids.device.type != "cpu" or is_fake(bad):
        torch._assert_async(ok, msg)  # a no-op on fake tensors
        return
    try:
        torch._assert_async(ok, msg)  # fake: also a real ids tensor under FakeTensorMode
    except RuntimeError:
        raise ValueError(f"{msg}: got {ids[bad][0].item()}") from None


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)`` of the ``(vocab, hidden)`` table; a token
    outside its range contributes zeros, and the ranks' partial outputs are summed. Token
    ids outside ``[0, vocab)`` are an error, as in ``nn.Embedding``.

    ``padding_idx`` as in ``nn.Embedding``: that row starts at zero and gets no gradient
    (the rank holding it passes its local index to ``F.embedding``). ``num_ids``: ids must
    be below it, for a table padded past the real vocabulary (default ``vocab``).

    Collectives: forward all-reduce of the ``(batch, seq, hidden)`` output over tp
    (``sequence_parallel``: reduce-scatter along the sequence, leaving ``(batch, seq/tp,
    hidden)``); backward none (``sequence_parallel``: all-gather of the gradient along the
    sequence). Default init: N(0, 1), as ``nn.Embedding``, drawn on the full table so it
    does not depend on tp.
    """

    def __init__(self, vocab: int, hidden: int, dims, sequence_parallel: bool = False,
                 dtype=None, device=None,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 padding_idx: int | None = None, num_ids: int | None = None):
        super().__init__()
        if vocab % dims.tp:
            pad = -vocab % dims.tp
            raise ValueError(f"vocab={vocab} is not divisible by tp={dims.tp}: pad the vocabulary "
                             f"to {vocab + pad} (a multiple of tp) or choose another tp")
        if padding_idx is not None and not -vocab <= padding_idx < vocab:
            raise ValueError(f"padding_idx={padding_idx} is outside the vocabulary of size "
                             f"{vocab}")
        if num_ids is not None and not 0 < num_ids <= vocab:
            raise ValueError(f"num_ids={num_ids}: the ids a padded table of {vocab} rows takes "
                             f"are in (0, {vocab}]")
        self.vocab, self.hidden, self.dims = vocab, hidden, dims
        self.num_ids = vocab if num_ids is None else num_ids
        self.padding_idx = padding_idx % vocab if padding_idx is not None else None
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.per_rank = vocab // dims.tp
        self.start = dims.tp_rank * self.per_rank
        full = torch.empty(vocab, hidden, dtype=dtype, device=device)
        (init_method or nn.init.normal_)(full)
        if self.padding_idx is not None:
            with torch.no_grad():
                full[self.padding_idx].zero_()
        self.weight = mark_tensor_parallel(nn.Parameter(shard(full, 0, dims.tp_rank, dims.tp)), 0)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, dims, sequence_parallel: bool = False
                   ) -> VocabParallelEmbedding:
        """Shard a dense ``nn.Embedding``'s rows (its ``padding_idx`` kept); ``max_norm``,
        ``scale_grad_by_freq`` and ``sparse`` are not supported (a ValueError names them)."""
        unsupported = {"max_norm": emb.max_norm is not None,
                       "scale_grad_by_freq": emb.scale_grad_by_freq, "sparse": emb.sparse}
        for name, on in unsupported.items():
            if on:
                raise ValueError(f"VocabParallelEmbedding.from_dense: nn.Embedding's "
                                 f"{name}={getattr(emb, name)!r} is not supported; build the "
                                 f"embedding without it")
        m = cls(emb.num_embeddings, emb.embedding_dim, dims, sequence_parallel=sequence_parallel,
                dtype=emb.weight.dtype, device=emb.weight.device, padding_idx=emb.padding_idx)
        with torch.no_grad():
            m.weight.copy_(shard(emb.weight, 0, dims.tp_rank, dims.tp))
        return m

    def _local_padding_idx(self) -> int | None:
        """``padding_idx`` as an index into this rank's rows, or None if another rank has it."""
        p = self.padding_idx
        return p - self.start if p is not None and 0 <= p - self.start < self.per_rank else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp, group = self.dims.tp, self.dims.tp_group
        check_ids_in_vocab(ids, self.num_ids, "VocabParallelEmbedding: token ids")
        if tp == 1:
            return embedding(ids, self.weight, self.padding_idx)
        if self.sequence_parallel and (ids.dim() != 2 or ids.shape[1] % tp):
            raise ValueError(f"VocabParallelEmbedding: ids of shape {tuple(ids.shape)}: under "
                             f"sequence_parallel=True they must be (batch, seq) with seq a "
                             f"multiple of tp={tp}")
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        # (b, s, h) partial; ids of other ranks read row 0 and are zeroed (no gradient)
        out = embedding(local.masked_fill(outside, 0), self.weight, self._local_padding_idx())
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(out, group)
        return reduce_from_tp_region(out, group)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.vocab}/tp={self.dims.tp}, {self.hidden}, sp={self.sequence_parallel}{pad}"
