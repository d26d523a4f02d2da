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


def test_on_cuda_the_probe_times_on_the_models_gpu(monkeypatch):
    """Its events go on the model's GPU's stream and it waits for that GPU; before, they
    went on the current device (cuda:0 where a rank never set its own: an idle stream,
    which times the host between the hooks) and it waited for that one. (No GPU here: the
    CUDA calls are stand-ins that record their device.)"""
    import torch

    from distllm.diagnostics.probe import Probe

    calls = []

    class Event:
        def __init__(self, enable_timing):
            self.t = len(calls)

        def record(self, stream=None):
            calls.append(("record", stream))

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(
        ("synchronize", device)))
    gpu = torch.device("cuda", 1)
    probe = Probe([], cuda=True, device=gpu)
    probe._begin("attn.o", "forward")
    probe._end("attn.o", "forward")
    assert probe.ms("attn.o", "forward") == 2.0
    assert calls == [("record", ("stream", gpu))] * 2 + [("synchronize", gpu)]
