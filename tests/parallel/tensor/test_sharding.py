"""Sharding helpers, without processes: the blocks of every rank rebuild the full tensor,
the full tensor is initialised alike whatever tp, and the divisibility error names the
knob."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.parallel.tensor.sharding import (
    check_divisible,
    init_full_weight,
    mark_sequence_parallel,
    mark_tensor_parallel,
    shard,
)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_rebuild_the_full_tensor(dim, world):
    t = torch.randn(12, 24, dtype=torch.float64).t()  # (24, 12), non-contiguous
    parts = [shard(t, dim, r, world) for r in range(world)]
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, dim), t)
    parts[0].zero_()  # a copy: the full tensor is untouched
    assert not torch.equal(torch.cat(parts, dim), t)


def test_full_weight_is_the_same_whatever_tp():
    torch.manual_seed(3)
    a = init_full_weight((7, 5), 5, None, torch.float64, "cpu")
    torch.manual_seed(3)
    ref = nn.Linear(5, 7, dtype=torch.float64).weight  # uniform(+-1/sqrt(fan_in)) as well
    assert (a - ref.detach()).abs().max() < 1e-15  # same draws; the bound's last bit differs
    torch.manual_seed(3)
    assert torch.equal(init_full_weight((7, 5), 5, None, torch.float64, "cpu"), a)
    ones = init_full_weight((2, 3), 3, torch.nn.init.ones_, torch.float32, "cpu")
    assert torch.equal(ones, torch.ones(2, 3))


def test_marks():
    p = mark_tensor_parallel(nn.Parameter(torch.zeros(2)), 1)
    assert p.tensor_model_parallel and p.partition_dim == 1
    q = mark_sequence_parallel(nn.Parameter(torch.zeros(2)))
    assert q.sequence_parallel and not getattr(q, "tensor_model_parallel", False)


def test_divisibility_error_names_the_knob():
    check_divisible(12, 4, "out_features", "out_features")
    with pytest.raises(ValueError, match=r"out_features=10 is not divisible by tp=4: choose "
                                         r"out_features divisible by 4, or tp in \[1, 2, 5, 10\]"):
        check_divisible(10, 4, "out_features", "out_features")
