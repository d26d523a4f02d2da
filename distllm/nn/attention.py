"""``ParallelAttention`` (heads split over tp, grouped-query, causal) and its dense
counterpart ``DenseAttention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distllm.nn.parallel_linear import ColumnParallelLinear, RowParallelLinear
from distllm.parallel.tensor.sharding import shard

__all__ = ["ParallelAttention", "DenseAttention", "check_heads"]


def check_heads(hidden: int, n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Raise a ValueError naming the knob unless the head counts fit ``tp``."""
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r}: give a positive number of heads")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}: choose n_heads "
                         f"dividing hidden")
    if n_heads % n_kv_heads:
        ok = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
        raise ValueError(f"n_kv_heads={n_kv_heads} does not divide n_heads={n_heads}: choose "
                         f"n_kv_heads among {ok}")
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tp={tp}: choose tp in "
                             f"{[d for d in range(1, n + 1) if n % d == 0]} or another {name}")


def _attend(q, k, v, causal: bool) -> torch.Tensor:
    """(b, s, hq, d), (b, s, hkv, d) x2 -> (b, s, hq*d); each kv head serves hq/hkv q heads."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (b, hq, s, d)
    return o.transpose(1, 2).reshape(b, s, hq * d)



def _check_3d(x: torch.Tensor, m: nn.Module) -> None:
    if x.dim() != 3:
        raise ValueError(f"{type(m).__name__} takes (batch, seq, hidden) input, got shape "
                         f"{tuple(x.shape)}: for one sequence pass x.unsqueeze(0)")

class DenseAttention(nn.Module):
    """Multi-head / grouped-query attention with ``q``, ``k``, ``v``, ``o`` ``nn.Linear``s:
    the single-process reference of :class:`ParallelAttention`."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int | None = None,
                 bias: bool = True, causal: bool = True, dtype=None, device=None):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, (n_heads if n_kv_heads is None else n_kv_heads)
        check_heads(hidden, n_heads, self.n_kv_heads, 1)
        self.head_dim, self.causal = hidden // n_heads, causal
        kv = self.n_kv_heads * self.head_dim
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.q, self.k = nn.Linear(hidden, hidden, **kw), nn.Linear(hidden, kv, **kw)
        self.v, self.o = nn.Linear(hidden, kv, **kw), nn.Linear(hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_3d(x, self)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.v(x).view(b, s, self.n_kv_heads, self.head_dim)
        return self.o(_attend(q, k, v, self.causal))


class ParallelAttention(nn.Module):
    """Attention with the heads split over tp: a fused column-parallel QKV projection (rank
    ``r`` holds its ``n_heads/tp`` query heads and ``n_kv_heads/tp`` key/value heads), local
    causal attention, and a row-parallel output projection.

    Collectives: forward the all-reduce of the output projection, chunked and overlapped with
    its GEMM; backward the all-reduce of the QKV input gradient, overlapped with the QKV
    weight-gradient GEMM. Under ``sequence_parallel`` (input and output ``(batch, seq/tp,
    hidden)``): forward all-gather of the input overlapped with the QKV GEMM and reduce-scatter
    of the output overlapped with the output GEMM; backward their mirror images.
    ``overlap_stats`` maps ``qkv`` / ``o`` to their ``OverlapStats``.

    Its own random initialisation draws the full QKV weight in the rank-major layout it
    stores (``[q_0; k_0; v_0; q_1; ...]``), so the same seed gives another model at another
    tp. For weights that do not depend on tp, load them: :meth:`from_dense`, or the GPT's
    canonical initialisation (:func:`distllm.models.sharding.init_canonical`).
    """

    def __init__(self, hidden: int, n_heads: int, dims, n_kv_heads: int | None = None,
                 bias: bool = True, sequence_parallel: bool = False, overlap: str = "auto",
                 chunks: int = 4, causal: bool = True, dtype=None, device=None):
        super().__init__()
        n_kv = n_heads if n_kv_heads is None else n_kv_heads
        check_heads(hidden, n_heads, n_kv, dims.tp)
        self.hidden, self.n_heads, self.n_kv_heads, self.dims = hidden, n_heads, n_kv, dims
        self.head_dim, self.causal = hidden // n_heads, causal
        self.local_heads, self.local_kv = n_heads // dims.tp, n_kv // dims.tp
        kw = dict(bias=bias, sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks,
                  dtype=dtype, device=device)
        # full QKV weight laid out rank-major: [q_0; k_0; v_0; q_1; k_1; v_1; ...]
        self.qkv = ColumnParallelLinear(hidden, (n_heads + 2 * n_kv) * self.head_dim, dims, **kw)
        self.o = RowParallelLinear(n_heads * self.head_dim, hidden, dims, **kw)
        self.recompute_core = False  # selective recomputation (set by a GPT block)

    @property
    def overlap_stats(self) -> dict:
        return {"qkv": self.qkv.overlap_stats, "o": self.o.overlap_stats}

    @classmethod
    def from_dense(cls, attn: DenseAttention, dims, sequence_parallel: bool = False,
                   overlap: str = "auto", chunks: int = 4) -> ParallelAttention:
        """Shard a :class:`DenseAttention` (``q``/``k``/``v``/``o`` Linears) by heads."""
        if not isinstance(attn, DenseAttention):
            raise ValueError(
                f"ParallelAttention.from_dense needs a distllm DenseAttention (q/k/v/o "
                f"Linears and its head counts), not {type(attn).__name__}: Hugging Face GPT-2 "
                f"weights come in through distllm.models.hf (--init-from)")
        w = attn.q.weight
        m = cls(w.shape[1], attn.n_heads, dims, n_kv_heads=attn.n_kv_heads,
                bias=attn.q.bias is not None, sequence_parallel=sequence_parallel,
                overlap=overlap, chunks=chunks, causal=attn.causal, dtype=w.dtype,
                device=w.device)
        r, tp = dims.tp_rank, dims.tp
        with torch.no_grad():
            for name in ("weight", "bias"):
                dst = getattr(m.qkv, name)
                if dst is None:
                    continue
                q, k, v = (getattr(getattr(attn, p), name) for p in "qkv")
                dst.copy_(torch.cat([shard(t, 0, r, tp) for t in (q, k, v)]))
            m.o.weight.copy_(shard(attn.o.weight, 1, r, tp))
            if m.o.bias is not None:
                m.o.bias.copy_(attn.o.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_3d(x, self)
        y = self.qkv(x)  # (b, s, (hq + 2 hkv)/tp * d), s the full sequence
        b, s, _ = y.shape
        d, hq, hkv = self.head_dim, self.local_heads, self.local_kv
        q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
        if self.recompute_core and torch.is_grad_enabled():  # keeps Q, K, V; not the scores
            from torch.utils.checkpoint import checkpoint

            ctx = checkpoint(_attend, q, k, v, self.causal, use_reentrant=False)
        else:
            ctx = _attend(q, k, v, self.causal)  # (b, s, hq*d)
        return self.o(ctx)  # (b, s, h), or (b, s/tp, h) under sequence parallelism
