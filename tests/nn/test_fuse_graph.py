"""What fuse(model) reads from a block's graph: chains of Linear -> GeLU pairs (every GeLU
fused, the last pair a whole MLP), blocks with optional arguments (only the edges found with
each argument None and given), and a failure part-way leaving the model as it was. Parity
with the unfused model in float64 (cpu backend) and float32 (triton, interpreted)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from distllm.nn import FusedLinearGeLU, fuse
from distllm.nn import fused as fused_mod
from distllm.nn.fuse_graph import MAX_OPTIONAL_ARGS
from tests.nn.test_fused import BACKENDS, TOL, _fused_copy, _same_outputs_and_grads

F64 = dict(rtol=1e-12, atol=1e-12)  # float64: the same math, another association order


def _types(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuse_chain_of_three_linears(backend):
    """L -> G -> L -> G -> L: the first pair alone, the second with the last Linear."""
    ref = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 7),
                        nn.GELU(approximate="tanh"), nn.Linear(7, 2)).double()
    keys = set(ref.state_dict())
    model = _fused_copy(ref, backend, 2)
    assert type(model[0]) is FusedLinearGeLU and model[0].approximate == "none"
    assert type(model[2]).__name__ == "_FusedMLPHead" and model[2].approximate == "tanh"
    assert model[2]._tail is model[4] and type(model[4]).__name__ == "_FusedAway"
    assert isinstance(model[1], nn.Identity) and isinstance(model[3], nn.Identity)
    assert set(model.state_dict()) == keys
    _same_outputs_and_grads(ref, model, torch.randn(2, 3, 4, dtype=torch.float64))
    assert fuse(model) == 0  # idempotent


def test_fuse_chain_of_four_pairs_and_a_trailing_gelu():
    ref = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.GELU())],
                        nn.Linear(6, 3), nn.GELU(), nn.Linear(3, 5)).double()
    model = _fused_copy(ref, "cpu", 5)
    heads = [type(model[i]).__name__ for i in range(0, 12, 2)]
    assert heads == ["FusedLinearGeLU"] * 4 + ["_FusedMLPHead", "_FusedAway"]
    _same_outputs_and_grads(ref, model, torch.randn(7, 6, dtype=torch.float64))


class _Gate(nn.Module):  # an optional gate on the hidden units, between act and proj
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x, scale=None):
        h = self.act(self.fc(x))
        if scale is not None:
            h = h * scale
        return self.proj(h)


class _ScaleFirst(_Gate):  # the optional scale between fc and act: no pair at all
    def forward(self, x, scale=None):
        h = self.fc(x)
        if scale is not None:
            h = h * scale
        return self.proj(self.act(h))


class _OnlyOneGiven(_Gate):  # code between act and proj only when a is given and b is not
    def forward(self, x, a=None, b=None):
        h = self.act(self.fc(x))
        if a is not None and b is None:
            h = h * a
        return self.proj(h)


def _args(shape_last: int) -> list[tuple]:
    return [(), (torch.tensor(0.0, dtype=torch.float64),),
            (torch.rand(4, shape_last, dtype=torch.float64),)]


@pytest.mark.parametrize("make,n,last", [(_Gate, 1, 32), (_ScaleFirst, 0, 32)],
                         ids=["gate-between-act-and-proj", "scale-between-fc-and-act"])
def test_fuse_block_with_an_optional_argument_matches_with_it_given(make, n, last):
    torch.manual_seed(0)
    ref = make().double()
    block = copy.deepcopy(ref)
    assert fuse(block) == n
    assert type(block.proj) is nn.Linear  # the MLP is never whole in every trace
    x = torch.randn(4, 8, dtype=torch.float64)
    for args in _args(last):
        torch.testing.assert_close(block(x, *args), ref(x, *args), **F64)


def test_fuse_block_with_two_optional_arguments_traces_each_combination():
    torch.manual_seed(0)
    ref = _OnlyOneGiven().double()
    block = copy.deepcopy(ref)
    assert fuse(block) == 1 and type(block.fc) is FusedLinearGeLU
    assert type(block.proj) is nn.Linear
    x, a, b = (torch.randn(4, 8, dtype=torch.float64), torch.rand(4, 32, dtype=torch.float64),
               torch.ones(2, dtype=torch.float64))
    for kw in ({}, {"a": a}, {"b": b}, {"a": a, "b": b}):
        torch.testing.assert_close(block(x, **kw), ref(x, **kw), **F64, msg=str(list(kw)))


def test_fuse_leaves_a_block_with_too_many_optional_arguments_alone(caplog):
    names = ", ".join(f"o{i}=None" for i in range(MAX_OPTIONAL_ARGS + 1))
    scope: dict = {}
    exec(f"def forward(self, x, {names}):\n    return self.proj(self.act(self.fc(x)))", scope)
    block = type("_ManyOptional", (_Gate,), {"forward": scope["forward"]})()
    before = _types(block)
    with caplog.at_level(logging.DEBUG, logger="distllm"):
        assert fuse(block) == 0
    assert _types(block) == before
    assert any("optional arguments" in r.getMessage() for r in caplog.records)


def test_fuse_failing_part_way_leaves_the_model_as_it_was(monkeypatch):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                          nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                          nn.Linear(4, 4), nn.GELU())
    before = _types(model)
    real, calls = fused_mod._fused_mlp, []

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("cannot build the second MLP")
        return real(*args)

    monkeypatch.setattr(fused_mod, "_fused_mlp", second_fails)
    with pytest.raises(RuntimeError, match="second MLP"):
        fuse(model)
    assert _types(model) == before
    monkeypatch.setattr(fused_mod, "_fused_mlp", real)
    ref = copy.deepcopy(model).double()
    assert fuse(model.double()) == 3
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), **TOL[torch.float64])


def test_fuse_leaves_a_gelu_subclass_alone():
    """A subclass of nn.GELU may compute something else (here a clamp): not fused."""
    from tests.nn.test_mlp_from_dense import _ClippedGELU

    model = nn.Sequential(nn.Linear(8, 16), _ClippedGELU(), nn.Linear(16, 4)).double()
    before = _types(model)
    assert fuse(model) == 0 and _types(model) == before

