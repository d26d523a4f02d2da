"""Writing and reading a checkpoint's canonical tensors as pieces, through DCP's planners.

A canonical tensor (``model.layers.3.attn.qkv.weight``, full shape) is held by the ranks in
parts: each TP rank holds some boxes of it (:func:`distllm.models.sharding.tp_pieces`), and
the DP replicas of a box hold it alike. :class:`PieceSavePlanner` hands DCP each rank's boxes
as chunks of the canonical tensor: nothing is gathered, and DCP writes a box held by several
ranks once (its save plans deduplicate chunks at the same offsets). :class:`PieceLoadPlanner`
asks DCP for this rank's boxes only: DCP reads the stored chunks that overlap them,
whatever layout wrote them (a checkpoint of whole tensors included), and copies out the
overlaps.

Both are DCP's documented extension point (a ``SavePlanner``'s ``create_local_plan`` and
``lookup_object``, a ``LoadPlanner``'s ``create_local_plan`` and ``lookup_tensor``). A saved
checkpoint's metadata names the canonical tensors with their full shapes, so
``dcp.load`` of full tensors (:func:`distllm.train.checkpoint.read_layers`) reads it as it is.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["Pieces", "PieceLoadPlanner", "PieceSavePlanner"]

# canonical name -> (its full shape, [(offsets of a box in it, the box's tensor)])
Pieces = dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]


def _boxes(pieces: Pieces) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    return {(fqn, tuple(off)): t for fqn, (_, boxes) in pieces.items() for off, t in boxes}


def _chunk(off: tuple[int, ...], t: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size())


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class PieceSavePlanner(DefaultSavePlanner):
    """Saves ``pieces``: this rank's boxes of each canonical tensor (``dcp.save({}, ...,
    planner=PieceSavePlanner(pieces))``). DCP's global plan checks that the ranks' boxes
    together cover each tensor once."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__()
        self._pieces = pieces
        self._box = _boxes(pieces)

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=_chunk(off, t), properties=TensorProperties.create_from_tensor(t),
                          size=torch.Size(shape)))
            for fqn, (shape, boxes) in self._pieces.items() for off, t in boxes]
        # (the names DCP's flattening would record: the state is flat)
        self.plan = SavePlan(items, planner_data={fqn: (fqn,) for fqn in self._pieces})
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self._box[(index.fqn, tuple(index.offset))]


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads ``pieces``' boxes (tensors to fill, their shapes the boxes') from a checkpoint
    (``dcp.load({}, ..., planner=PieceLoadPlanner(pieces))``). A canonical tensor the
    checkpoint lacks, or holds at another shape, is a ValueError naming it."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__()
        self._pieces = pieces
        self._box = _boxes(pieces)

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for fqn, (shape, boxes) in self._pieces.items():
            md = stored.get(fqn)
            if md is None:
                raise ValueError(f"the checkpoint holds no {fqn}")
            if tuple(md.size) != tuple(shape):
                raise ValueError(f"the checkpoint holds {fqn} at shape {tuple(md.size)}, "
                                 f"not {tuple(shape)}")
            mine = create_read_items_for_chunk_list(fqn, md, [_chunk(o, t) for o, t in boxes])
            read = sum(_volume(item.lengths) for item in mine)
            if read != sum(t.numel() for _, t in boxes):  # stored chunks that leave a gap
                raise ValueError(f"the checkpoint's chunks of {fqn} do not cover it")
            items += mine
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._box[(index.fqn, tuple(index.offset))]
