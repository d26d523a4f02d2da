"""Writing and reading a checkpoint's canonical tensors as pieces, through DCP's planners.

A canonical tensor (``model.layers.3.attn.qkv.weight``, full shape) is held by the ranks in
parts: each TP rank holds some boxes of it (:func:`distllm.models.sharding.tp_pieces`), and
the DP replicas of a box hold it alike. :class:`PieceSavePlanner` hands DCP each rank's boxes
as chunks of the canonical tensor: nothing is gathered, and DCP writes a box held by several
ranks once (its save plans deduplicate chunks at the same offsets). :class:`PieceLoadPlanner`
asks DCP for this rank's boxes only: DCP loads the stored chunks that overlap them, each
once, whatever layout wrote them (a checkpoint of whole tensors included), and copies out
the overlaps.

Both use DCP's documented extension points (a ``SavePlanner``'s ``create_local_plan`` and
``lookup_object``; a ``LoadPlanner``'s ``create_local_plan``, ``lookup_tensor``,
``resolve_tensor`` and ``commit_tensor``). A saved
checkpoint's metadata names the canonical tensors with their full shapes, so
``dcp.load`` of full tensors (:func:`distllm.train.checkpoint.read_layers`) reads it as it is.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

__all__ = ["Pieces", "PieceLoadPlanner", "PieceSavePlanner"]

# canonical name -> (its full shape, [(offsets of a box in it, the box's tensor)])
Pieces = dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]


def _boxes(pieces: Pieces) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    return {(fqn, tuple(off)): t for fqn, (_, boxes) in pieces.items() for off, t in boxes}


def _chunk(off: tuple[int, ...], t: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.size())


class PieceSavePlanner(DefaultSavePlanner):
    """Saves ``pieces``: this rank's boxes of each canonical tensor (``dcp.save({}, ...,
    planner=PieceSavePlanner(pieces))``). With more than one rank, DCP's global plan checks
    that the ranks' boxes together cover each tensor once; :class:`PieceLoadPlanner` refuses
    a gap in what it reads in any case."""

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


def _overlap(a_off, a_size, b_off, b_size):
    """``(offsets, sizes)`` of two boxes' intersection, or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_size, b_off, b_size, strict=True)]
    return None if any(x >= y for x, y in zip(lo, hi, strict=True)) else (
        lo, [y - x for x, y in zip(lo, hi, strict=True)])


def _region(lo, size, base) -> tuple[slice, ...]:
    """The index of the box ``(lo, size)`` in a tensor whose first element is at ``base``."""
    return tuple(slice(x - b, x - b + n) for x, n, b in zip(lo, size, base, strict=True))


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads ``pieces``' boxes (tensors to fill, their shapes the boxes') from a checkpoint
    (``dcp.load({}, ..., planner=PieceLoadPlanner(pieces))``). A canonical tensor the
    checkpoint lacks, holds at another shape, or whose stored chunks leave a gap in a box,
    is a ValueError naming it.

    DCP's file reader loads a stored chunk whole for each request it serves. A stored chunk
    that overlaps one box is one request, into that box; one that overlaps several (a
    checkpoint saved at another layout: a whole tensor and this rank's q, k and v heads, or
    its ZeRO range's rows) is one request for the region that bounds those overlaps, into a
    buffer made when DCP asks for it (:meth:`resolve_tensor`) and copied into the boxes when
    DCP hands it back (:meth:`commit_tensor`): each stored chunk is loaded once."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__()
        self._pieces = pieces
        self._box = _boxes(pieces)
        # (fqn, stored chunk's offsets) -> (the region's offsets, [(box offsets, overlap)])
        self._shared: dict[tuple, tuple[list[int], list]] = {}

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
            covered = 0
            for chunk in md.chunks:
                hits = [(off, ov) for off, t in boxes
                        if (ov := _overlap(off, t.shape, chunk.offsets, chunk.sizes))]
                covered += sum(math.prod(ov[1]) for _, ov in hits)
                items += self._reads(fqn, chunk, hits)
            if covered != sum(t.numel() for _, t in boxes):  # stored chunks leave a gap
                raise ValueError(f"the checkpoint's chunks of {fqn} do not cover it")
        return LoadPlan(items)

    def _reads(self, fqn: str, chunk: ChunkStorageMetadata, hits: list) -> list[ReadItem]:
        """The read of stored ``chunk`` for this rank's ``hits`` (box offsets, overlap)."""
        if not hits:
            return []
        if len(hits) == 1:  # into the box itself, whose first element is at its offsets
            (base, (lo, size)), = hits
        else:  # the region bounding the overlaps, read once into a buffer of its own
            lo = [min(ov[0][d] for _, ov in hits) for d in range(len(chunk.offsets))]
            size = [max(ov[0][d] + ov[1][d] for _, ov in hits) - lo[d]
                    for d in range(len(lo))]
            self._shared[(fqn, tuple(chunk.offsets))] = (lo, hits)
            base = lo
        return [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, torch.Size(base)),
                         dest_offsets=torch.Size(x - b for x, b in zip(lo, base, strict=True)),
                         storage_index=MetadataIndex(fqn, chunk.offsets),
                         storage_offsets=torch.Size(x - c for x, c in zip(lo, chunk.offsets,
                                                                          strict=True)),
                         lengths=torch.Size(size))]

    def _group(self, item: ReadItem):
        return self._shared.get((item.storage_index.fqn, tuple(item.storage_index.offset)))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._box[(index.fqn, tuple(index.offset))]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self._group(read_item) is None:
            return super().resolve_tensor(read_item)  # (the box's part)
        md = self.metadata.state_dict_metadata[read_item.dest_index.fqn]
        return torch.empty(read_item.lengths, dtype=md.properties.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        group = self._group(read_item)
        if group is None:
            return
        base, hits = group
        fqn = read_item.dest_index.fqn
        for off, (lo, size) in hits:
            box = self._box[(fqn, tuple(off))]
            box[_region(lo, size, off)].copy_(tensor[_region(lo, size, base)])
