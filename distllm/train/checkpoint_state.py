"""What each rank writes to a checkpoint and reads from one: its own boxes of the canonical
tensors (:mod:`distllm.train.checkpoint`'s format), with no collective.

A parameter's part on this rank is its TP shard (:func:`~distllm.models.sharding.tp_pieces`
places it in the canonical tensor) and, under ZeRO, only the range of the shard's flattened
elements that this DP rank's optimizer shard holds
(:func:`~distllm.parallel.data.zero_state.shard_pieces`;
:func:`~distllm.models.sharding.flat_pieces` cuts that range into boxes). A save hands those
boxes to DCP (views of the weights and moments it holds, no copy; DCP copies each to the
CPU as it writes it); a load fills the same boxes, laid out the same way, and installs
them. So no rank gathers another's state, and a resume reads only the stored chunks that
overlap its own boxes, each once (at the layout that saved them: exactly its own state).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from distllm.models.sharding import (
    canonical_shapes,
    flat_pieces,
    module_paths,
    param_table,
    tp_pieces,
)
from distllm.parallel.data.zero_state import shard_pieces, shard_targets
from distllm.train.dcp_pieces import Pieces
from distllm.train.optim_state import MOMENTS, collect, install

__all__ = ["entries", "own_pieces", "read_targets"]


def entries(engine):
    """``(chunk, layer index, canonical name, path in layer, parameter)`` of this rank."""
    for chunk in engine.chunks:
        for i in chunk.layer_ids:
            layer = chunk.layers[str(i)]
            for name, path in module_paths(chunk.cfg, i).items():
                yield chunk, i, name, path, layer.get_parameter(path)


def _fqn(i: int, name: str, key: str) -> str:
    return f"model.layers.{i}.{name}" if key == "weight" else f"optim.layers.{i}.{name}.{key}"


def _boxes(engine, ents: list, ranges: list) -> Pieces:
    """The boxes of the canonical tensors of ``ents`` (:func:`entries`), ``ranges[k]`` giving
    entry ``k``'s as ``(its TP shard's shape, [(start, stop, {key: flat values of the shard's
    flattened elements [start, stop)})])``."""
    pieces: Pieces = {}
    for (chunk, i, name, _, _), (local, parts) in zip(ents, ranges, strict=True):
        kind = param_table(chunk.cfg, i, chunk.vocab_parallel)[name][1]
        shape = canonical_shapes(chunk.cfg, i)[name]
        where = tp_pieces(chunk.cfg, engine.dims, kind, shape)
        for start, stop, values in parts:
            for off, first, size in flat_pieces(local, start, stop, where):
                at, n = first - start, math.prod(size)
                for key, t in values.items():
                    pieces.setdefault(_fqn(i, name, key), (shape, []))[1].append(
                        (off, t[at: at + n].view(size)))
    return pieces


def _whole(ents: list, local: dict) -> list:
    """:func:`_boxes`' ranges of a run without ZeRO: each parameter's whole TP shard, its
    ``{key: tensor}`` in ``local``, flattened."""
    return [(tuple(e[4].shape), [(0, e[4].numel(), {k: t.detach().reshape(-1)
                                                    for k, t in local[e[4]].items()})])
            for e in ents]


def own_pieces(engine) -> tuple[Pieces, int]:
    """This rank's boxes of its canonical tensors (of its weights and moments: the fp32
    masters and their moments under mixed precision) and the optimizer step."""
    ents = list(entries(engine))
    if engine.zero is not None:
        own, step = shard_pieces(engine.zero)
        names = engine.zero.names
        return _boxes(engine, ents, [own.get(names[e[4]], ((), [])) for e in ents]), step
    local, step = collect(engine, [e[4] for e in ents])
    return _boxes(engine, ents, _whole(ents, local)), step


def read_targets(engine, with_optim: bool) -> tuple[Pieces, Callable[[int], None]]:
    """Boxes to read this rank's state into (zeros, on the CPU), as :func:`own_pieces` lays
    them out, and ``commit(optimizer step)``, which installs what they were filled with
    (collective over DP under ZeRO)."""
    keys = ("weight", *MOMENTS) if with_optim else ("weight",)
    ents = list(entries(engine))
    if engine.zero is not None:
        own, commit = shard_targets(engine.zero, keys)
        names = engine.zero.names
        return _boxes(engine, ents, [own.get(names[e[4]], ((), [])) for e in ents]), commit
    # (no ZeRO: the parameters are in the training dtype; bf16 always has ZeRO's masters)
    local = {e[4]: {k: torch.zeros(e[4].shape, dtype=e[4].dtype) for k in keys} for e in ents}
    return _boxes(engine, ents, _whole(ents, local)), lambda step: install(engine, local, step)
