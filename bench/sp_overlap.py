"""Benchmark: the sequence-parallel pair, 2 gloo ranks, optionally over an emulated link.

- Case ``ag M,K,N`` (column-parallel forward under sequence parallelism): all-gather of the
  ``(M/2, K)`` sequence shards into ``(M, K)``, then ``(M, K) @ (K, N)``; the engine computes
  the local shard's rows while the first chunk of the other shard arrives, then chunk by chunk.
- Case ``rs M,K,N`` (row-parallel forward under sequence parallelism): ``(M, K) @ (K, N)``
  then reduce-scatter of the ``(M, N)`` result along the sequence, chunk by chunk.

Variants as in :mod:`distllm.bench.row_parallel_overlap`: the parts alone
(``allgather_alone`` / ``reducescatter_alone``, ``gemm``, ``gemm_chunked<c>`` for the chunking
penalty, and each schedule's ``compute_alone_c<c>`` / ``comm_alone_c<c>``), ``sequential``,
``chunked<c>``, ``auto`` (the module with ``overlap="auto"``) and ``ideal`` = max(GEMM,
collective); ``hidden_frac`` = (compute + comm - variant) / min(compute, comm) with the
variant's own parts, the share of what could hide (ceiling 1).
On gloo the reduce-scatter is the engine's pairwise exchange (``reducescatter_alone``);
``torch_reducescatter_alone`` times torch's reduce-scatter (through
:func:`distllm.comm.compat.reduce_scatter_into`) for scale.
The cases are built, timed and reported by :mod:`distllm.bench.row_parallel_overlap`'s
``setup`` and ``rows``. Run: ``distllm bench --suite sp_overlap --net 2gbit``.
"""

from __future__ import annotations

from distllm.bench.harness import BenchConfig, Case
from distllm.bench.row_parallel_overlap import CPU_DTYPES, kind_cases, rows, setup

__all__ = ["SUITE", "cases", "setup", "rows"]

SUITE = "sp_overlap"
# ag: a comm-heavy all-gather has K large; rs: a comm-heavy reduce-scatter has N large
PRESETS = {True: [(256, 256, 256)], False: [(2048, 512, 2048), (2048, 2048, 512)]}


def cases(cfg: BenchConfig) -> list[Case]:
    skip = "" if cfg.device == "cpu" and cfg.dtype in CPU_DTYPES else (
        f"this suite runs 2 gloo ranks on CPU (device={cfg.device}, dtype={cfg.dtype})")
    return kind_cases(cfg, SUITE, ("ag", "rs"), PRESETS, skip)
