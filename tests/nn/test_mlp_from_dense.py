"""``ParallelMLP.from_dense`` reads the dense MLP's activation: a GeLU (module or function
attribute, exact or tanh) becomes the matching ParallelMLP, checked in float64 against the
dense module on one process and on 2 gloo ranks; any other activation is a ValueError that
names it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.activations import NewGELUActivation, QuickGELUActivation

from distllm.nn import ParallelMLP
from distllm.testing import run_distributed
from tests._errors import worst

TOL = 1e-10  # float64: the same GEMMs and GeLU, sharded


class _MLP(nn.Module):  # fc1 -> act -> fc2, the activation a child or a function attribute
    def __init__(self, act, h: int = 6, f: int = 12):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(h, f), act, nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Inline(_MLP):  # the activation called inline: nothing to read but the graph
    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class _DropoutBetween(_MLP):
    def __init__(self):
        super().__init__(nn.GELU())
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class _Named(nn.Module):  # DenseMLP's convention: the activation by name, no forward read
    def __init__(self, name: str):
        super().__init__()
        self.fc1, self.fc2, self.activation = nn.Linear(6, 12), nn.Linear(12, 6), name


class _Dims1:
    """tp=1 without a process group (nothing here communicates)."""

    tp, tp_rank, tp_group = 1, 0, None


GELUS = {
    "GELU": (lambda: nn.GELU(), "gelu"),
    "GELU-tanh": (lambda: nn.GELU(approximate="tanh"), "gelu_tanh"),
    "NewGELUActivation": (NewGELUActivation, "gelu_tanh"),
    "F.gelu": (lambda: F.gelu, "gelu"),
    "partial-tanh": (lambda: functools.partial(F.gelu, approximate="tanh"), "gelu_tanh"),
}


def _parity(dims, make, backend: str) -> float:
    """max |parallel - dense| over the output, the input gradient and fc1's weight gradient
    (this rank's rows)."""
    torch.manual_seed(0)
    dense = _MLP(make()).double()
    pm = ParallelMLP.from_dense(dense, dims, overlap="none", backend=backend)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = dense(xa), pm(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    rows = dense.fc1.weight.grad.chunk(dims.tp, 0)[dims.tp_rank]
    return worst((ya - yb).abs().max().item(), (xa.grad - xb.grad).abs().max().item(),
               (rows - pm.fc1.weight.grad).abs().max().item())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", list(GELUS))
def test_from_dense_keeps_the_gelu(name, backend):
    make, want = GELUS[name]
    assert ParallelMLP.from_dense(_MLP(make()), _Dims1()).fc1.activation == want
    assert _parity(_Dims1(), make, backend) < TOL


def _two_ranks() -> dict[str, float]:
    from distllm import ParallelDims

    dims = ParallelDims(tp=dist.get_world_size())
    return {name: _parity(dims, make, "cpu") for name, (make, _) in GELUS.items()}


def test_from_dense_keeps_the_gelu_on_two_ranks():
    for rank, errs in enumerate(run_distributed(_two_ranks, 2, timeout=120)):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {rank}: {bad}"


class _ClippedGELU(nn.GELU):
    """A GeLU subclass computing something else: not a GeLU to fuse."""

    def forward(self, x):
        return super().forward(x).clamp(max=0.5)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: _MLP(nn.ReLU()), r"its activation ReLU\(\) is not a GeLU"),
        (lambda: _MLP(nn.SiLU()), r"its activation SiLU\(\) is not a GeLU"),
        (lambda: _MLP(QuickGELUActivation()), r"QuickGELUActivation\(\) is not a GeLU"),
        (lambda: _Inline(nn.GELU()), "its activation silu is not a GeLU"),
        (lambda: _DropoutBetween(), "GeLU 'act' does not go to fc2 alone"),
        (lambda: _Named("relu"), r"_Named.activation='relu': ParallelMLP computes 'gelu'"),
        (lambda: _MLP(_ClippedGELU()), r"its activation _ClippedGELU\(approximate='none'\) "
                                       r"is not a GeLU"),
    ],
    ids=["ReLU", "SiLU", "QuickGELU", "inline-silu", "dropout-between", "named-relu",
         "gelu-subclass"],
)
def test_from_dense_refuses_other_activations(make, match):
    with pytest.raises(ValueError, match=match):
        ParallelMLP.from_dense(make(), _Dims1())


def test_from_dense_takes_a_named_activation():
    assert ParallelMLP.from_dense(_Named("gelu_tanh"), _Dims1()).fc1.activation == "gelu_tanh"


def test_attention_from_dense_refuses_another_attention():
    """Not a DenseAttention (torch's MultiheadAttention here): one ValueError naming where
    Hugging Face weights come in, not an AttributeError on ``.q``."""
    from distllm.nn import ParallelAttention

    with pytest.raises(ValueError, match=r"needs a distllm DenseAttention .* not "
                                         r"MultiheadAttention: Hugging Face GPT-2 weights"):
        ParallelAttention.from_dense(nn.MultiheadAttention(8, 2), _Dims1())
