"""The doctor's probe: the size of the tensor each collective of a tensor-parallel layer
moves, in each direction, from the layer's input and output on one rank."""

from __future__ import annotations

import pytest

from distllm.diagnostics.probe import full_numel

IN_N, OUT_N, TP = 12, 40, 4  # elements of the layer's input and output on this rank


@pytest.mark.parametrize("coll, direction, want", [
    ("all_reduce", "forward", OUT_N),  # row-parallel: Y summed over ranks
    ("all_reduce", "backward", IN_N),  # column-parallel: dX summed over ranks
    ("all_gather", "forward", IN_N * TP),  # column-parallel, sequence-parallel: X gathered
    ("all_gather", "backward", OUT_N * TP),  # row-parallel, sequence-parallel: dY gathered
    ("reduce_scatter", "forward", OUT_N * TP),  # row-parallel, sequence-parallel: full Y
    ("reduce_scatter", "backward", IN_N * TP),  # column-parallel, sequence-parallel: full dX
])
def test_full_numel(coll, direction, want):
    assert full_numel(coll, direction, IN_N, OUT_N, TP) == want
