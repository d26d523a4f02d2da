"""Splitting a model given as a sequence of layers into pipeline stages.

A model is a list of layers ``[embedding, block_0, ..., block_{n-1}, head]`` applied one after
the other. With ``pp`` ranks and ``v`` virtual stages (model chunks) per rank there are
``S = pp * v`` stages; stage ``s`` runs on pipeline rank ``s % pp`` as its chunk ``s // pp``
(the interleaved layout: rank 0 holds stages 0, pp, 2*pp, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["split_layers", "stage_of", "rank_chunk_of"]


def stage_of(pp_rank: int, chunk: int, pp: int) -> int:
    """Global stage index of ``chunk`` on pipeline rank ``pp_rank``."""
    return chunk * pp + pp_rank


def rank_chunk_of(stage: int, pp: int) -> tuple[int, int]:
    """``(pp_rank, chunk)`` holding global ``stage``."""
    return stage % pp, stage // pp


def split_layers(
    num_layers: int, pp: int, virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """Layer index ranges of the ``pp * virtual_stages`` stages, in stage order.

    Evenly by default: with ``virtual_stages == 1`` a remainder goes one layer each to the
    first stages; with interleaving the layer count must divide exactly (every chunk the same
    size, so that the schedule's equal-duration assumption holds). ``layers_per_stage`` gives
    the counts explicitly (one positive count per stage, summing to ``num_layers``).
    """
    for name, val in (("pp", pp), ("virtual_stages", virtual_stages)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}={val!r}: it must be a positive integer")
    stages = pp * virtual_stages
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != stages or any((not isinstance(c, int)) or c < 1 for c in counts):
            raise ValueError(
                f"layers_per_stage={counts}: give {stages} positive counts (one per stage, "
                f"pp={pp} x virtual_stages={virtual_stages}), in stage order"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"layers_per_stage={counts} sums to {sum(counts)} but the model has "
                f"{num_layers} layers: make the counts sum to {num_layers}"
            )
    else:
        if num_layers < stages:
            raise ValueError(
                f"the model has {num_layers} layers, fewer than the {stages} pipeline stages "
                f"(pp={pp} x virtual_stages={virtual_stages}): lower --pp or --virtual-stages "
                f"to at most {num_layers} stages in all, or add layers"
            )
        if virtual_stages > 1 and num_layers % stages:
            # (interleaving over pp > 1 ranks takes at least 2 chunks per rank: schedules)
            ok = [v for v in range(2 if pp > 1 else 1, num_layers // pp + 1)
                  if num_layers % (pp * v) == 0]
            choose = (f"choose --virtual-stages in {ok}" if ok else
                      f"no --virtual-stages >= 2 divides them: use a layer count divisible by "
                      f"{2 * pp}")
            raise ValueError(
                f"interleaving needs the {num_layers} layers to divide evenly into "
                f"pp={pp} x virtual_stages={virtual_stages} = {stages} chunks: {choose}, or "
                f"give layers_per_stage explicitly"
            )
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
