"""The canonical tensors' TP pieces, without processes: each rank's boxes are its shard, in
the canonical tensor's coordinates, and the ranks' boxes cover every element once; a ZeRO
rank's range of a shard's flattened elements is cut into boxes that hold those elements."""

from __future__ import annotations

import math
import types

import pytest
import torch

from distllm.models.config import GPTConfig
from distllm.models.sharding import (
    canonical_shapes,
    flat_pieces,
    param_table,
    shard_full,
    tp_pieces,
)

# grouped-query attention (8 query heads, 4 KV heads) and a vocabulary that tp pads (1000 rows)
CFG = GPTConfig(vocab_size=1000, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=4,
                ffn_hidden_size=256, max_seq_len=16)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layer", [0, 1, 3])  # the embedding, a block, the head
def test_each_ranks_boxes_are_its_shard_and_the_ranks_cover_each_tensor_once(tp, layer):
    for name, shape in canonical_shapes(CFG, layer).items():
        kind = param_table(CFG, layer)[name][1]
        full = torch.randn(shape, dtype=torch.float64)
        seen = torch.zeros(shape, dtype=torch.int64)
        for r in range(tp):
            dims = types.SimpleNamespace(tp=tp, tp_rank=r)
            shard = shard_full(CFG, dims, kind, full)
            covered = torch.zeros(shard.shape, dtype=torch.bool)
            for off, idx in tp_pieces(CFG, dims, kind, shape):
                box = shard[idx]
                where = tuple(slice(o, o + n) for o, n in zip(off, box.shape, strict=True))
                assert torch.equal(box, full[where]), (name, r, off)
                seen[where] += 1
                covered[idx] = True
            # what no box holds is the vocabulary's padding (zeros in the shard)
            assert not shard[~covered].any(), (name, r)
        if kind != "rep":  # a replicated tensor: every rank's one box is the whole of it
            assert bool((seen == 1).all()), name
        else:
            assert bool((seen == tp).all()), name


def test_qkv_is_three_boxes_under_tp_and_one_without():
    shape = canonical_shapes(CFG, 1)["attn.qkv.weight"]  # (8 + 2 * 4) heads of 8 rows
    one = tp_pieces(CFG, types.SimpleNamespace(tp=1, tp_rank=0), "qkv", shape)
    assert [off for off, _ in one] == [(0, 0)]
    two = tp_pieces(CFG, types.SimpleNamespace(tp=2, tp_rank=1), "qkv", shape)
    # rank 1: q heads 4-7 (rows 32-63), k heads 2-3 (64 + 16), v heads 2-3 (96 + 16)
    assert [(off, idx[0]) for off, idx in two] == [
        ((32, 0), slice(0, 32)), ((80, 0), slice(32, 48)), ((112, 0), slice(48, 64))]


def test_a_rank_holding_only_vocabulary_padding_has_no_box():
    cfg = GPTConfig(vocab_size=70, n_layers=1, hidden_size=64, n_heads=8, max_seq_len=16)
    # tp 4 pads 70 rows to 256: rank 1 holds rows 64-127 (6 real), ranks 2 and 3 none
    boxes = [tp_pieces(cfg, types.SimpleNamespace(tp=4, tp_rank=r), "vocab", (70, 64))
             for r in range(4)]
    assert [[(off, idx[0]) for off, idx in b] for b in boxes] == [
        [((0, 0), slice(0, 64))], [((64, 0), slice(0, 6))], [], []]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_range_of_a_shards_elements_is_the_boxes_that_hold_them(tp):
    """Ranges that split a flattened shard anywhere (mid-row, whole rows, one element): each
    part is a contiguous run of the range and equals the canonical tensor's box at its
    offsets; the ranges' parts together hold what the shard's boxes hold, once."""
    g = torch.Generator().manual_seed(0)
    for layer in (0, 1, 3):
        for name, shape in canonical_shapes(CFG, layer).items():
            kind = param_table(CFG, layer)[name][1]
            full = torch.randn(shape, dtype=torch.float64)
            for r in range(tp):
                dims = types.SimpleNamespace(tp=tp, tp_rank=r)
                shard = shard_full(CFG, dims, kind, full)
                flat, pieces = shard.reshape(-1), tp_pieces(CFG, dims, kind, shape)
                cuts = sorted({0, 1, flat.numel(), *torch.randint(
                    0, flat.numel() + 1, (5,), generator=g).tolist()})
                held = 0
                for start, stop in zip(cuts[:-1], cuts[1:], strict=True):
                    for off, first, size in flat_pieces(tuple(shard.shape), start, stop,
                                                        pieces):
                        n = math.prod(size)
                        assert start <= first and first + n <= stop, (name, start, stop)
                        where = tuple(slice(o, o + k) for o, k in zip(off, size, strict=True))
                        assert torch.equal(flat[first: first + n].view(size), full[where])
                        held += n
                assert held == sum(shard[idx].numel() for _, idx in pieces), (name, r)


def test_a_range_outside_the_shard_is_refused():
    with pytest.raises(ValueError, match=r"elements \[0, 8\) of a shard shaped \(0,\)"):
        flat_pieces((0,), 0, 8, [((0,), (slice(None),))])
