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


def test_a_layers_time_is_the_mean_of_its_calls_as_its_wait_is():
    """The row's wait is a mean per call (a sum over calls); the layer's time must be the
    same statistic, or compute = layer - wait mixes them (one slow call of three made a
    median layer time shorter than the mean wait)."""
    from distllm.diagnostics.probe import Probe

    probe = Probe([], cuda=False)
    probe.marks[("attn.o", "forward")] = [[0.0, 0.001], [1.0, 1.001], [2.0, 2.010]]
    assert abs(probe.ms("attn.o", "forward") - 4.0) < 1e-9
    assert probe.ms("mlp", "forward") is None
