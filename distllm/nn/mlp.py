"""``ParallelMLP`` (column-parallel GEMM + GeLU, then row-parallel GEMM) and its dense
counterpart ``DenseMLP``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distllm.nn.fuse_graph import block_pairs, consumer_of
from distllm.nn.parallel_linear import (
    ACTIVATIONS,
    ColumnParallelLinear,
    RowParallelLinear,
    _autocast_operands,
    _check_width,
)
from distllm.parallel.tensor.batch_split import deferring, with_bias
from distllm.parallel.tensor.fused_mlp import describe_kernel, parallel_mlp, resolve_backend
from distllm.parallel.tensor.sharding import check_divisible

__all__ = ["ParallelMLP", "DenseMLP"]


class DenseMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: the single-process reference of :class:`ParallelMLP`."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "gelu", bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        if activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"activation={activation!r}: use 'gelu' or 'gelu_tanh'")
        self.activation = activation
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=ACTIVATIONS[self.activation]))


def _dense_activation(mlp: nn.Module) -> str:
    """``mlp``'s activation as ParallelMLP names it ("gelu" / "gelu_tanh"); a ValueError
    naming the activation if it is anything else or cannot be read."""
    act = getattr(mlp, "activation", None)
    if isinstance(act, str):
        if act in ("gelu", "gelu_tanh"):
            return act
        raise ValueError(f"ParallelMLP.from_dense: {type(mlp).__name__}.activation={act!r}: "
                         "ParallelMLP computes 'gelu' or 'gelu_tanh' only")
    for p in block_pairs(mlp):
        if p.fc == "fc1" and p.fc2 == "fc2":
            return "gelu" if p.approximate == "none" else "gelu_tanh"
        if p.fc == "fc1":
            raise ValueError(f"ParallelMLP.from_dense: {type(mlp).__name__}: the output of its "
                             f"GeLU {p.act!r} does not go to fc2 alone; ParallelMLP computes "
                             "fc2(gelu(fc1(x))) with nothing between")
    found = consumer_of(mlp, "fc1")
    what = f"its activation {found}" if found else "its forward, not read as fc2(act(fc1(x))),"
    raise ValueError(f"ParallelMLP.from_dense: {type(mlp).__name__}: {what} is not a GeLU "
                     "(exact or tanh) between fc1 and fc2, the only MLP ParallelMLP computes")


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` column-parallel (fused GEMM + bias + GeLU on the
    local ``ffn_hidden/tp`` slice) and ``fc2`` row-parallel, run as one autograd Function
    (:func:`distllm.parallel.tensor.fused_mlp.parallel_mlp`) whose backward fuses the GeLU
    derivative and fc1's bias gradient into fc2's input-gradient GEMM (cuBLASLt
    DGELU_BGRAD, a Triton GEMM with that epilogue, or the GEMM and one pass on CPU).
    ``backend`` ("auto", "cuda", "triton", "cpu", "reference") pins what computes both
    fusions, as :func:`distllm.ops.linear_gelu`'s does; "reference" is the unfused path and
    "auto" may pick it where it measured faster (``overlap_stats["fc1"].kernel`` says).

    Collectives, two per layer over forward and backward together: forward the all-reduce of
    fc2's output, chunked and overlapped with fc2's GEMM; backward the all-reduce of fc1's
    input gradient, overlapped with fc1's weight-gradient GEMM. With ``sequence_parallel``
    they become, forward: all-gather of the input (overlapped with fc1's GEMM) and
    reduce-scatter of the output (overlapped with fc2's GEMM); backward: all-gather of the
    output gradient and reduce-scatter of the input gradient, likewise overlapped.
    Input/output ``(batch, seq, hidden)``, or ``(batch, seq/tp, hidden)`` under sequence
    parallelism. ``overlap_stats`` maps ``fc1`` / ``fc2`` to their ``OverlapStats``.
    """

    def __init__(self, hidden: int, ffn_hidden: int, dims, activation: str = "gelu",
                 bias: bool = True, sequence_parallel: bool = False, overlap: str = "auto",
                 chunks: int = 4, dtype=None, device=None, backend: str = "auto"):
        super().__init__()
        if activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"activation={activation!r}: use 'gelu' or 'gelu_tanh'")
        check_divisible(ffn_hidden, dims.tp, "ffn_hidden", "ffn_hidden")
        kw = dict(sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks,
                  dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, dims, bias=bias,
                                        activation=activation, backend=backend, **kw)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, dims, bias=bias, **kw)

    # fc1 and fc2 run inside this module's one function (their own forwards are not called):
    # tools that hook layers (the overlap doctor) time them here
    FUSED_CHILDREN = ("fc1", "fc2")

    @property
    def overlap_stats(self) -> dict:
        return {"fc1": self.fc1.overlap_stats, "fc2": self.fc2.overlap_stats}

    @classmethod
    def from_dense(cls, mlp: nn.Module, dims, sequence_parallel: bool = False,
                   overlap: str = "auto", chunks: int = 4, backend: str = "auto") -> ParallelMLP:
        """Shard a dense MLP with ``fc1`` / ``fc2`` ``nn.Linear``s: a :class:`DenseMLP` (or
        any module whose ``activation`` is "gelu" or "gelu_tanh"), or one whose forward is
        ``fc2(act(fc1(x)))`` with ``act`` a GeLU child (exact or tanh, read from its graph as
        :func:`distllm.nn.fuse` does). Any other activation is a ValueError naming it."""
        fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
        if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear):
            raise ValueError("ParallelMLP.from_dense needs a module with nn.Linear attributes "
                             f"fc1 and fc2, got {type(mlp).__name__}")
        act = _dense_activation(mlp)
        check_divisible(fc1.out_features, dims.tp, "ffn_hidden", "ffn_hidden")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        kw = dict(sequence_parallel=sequence_parallel, overlap=overlap, chunks=chunks)
        m.fc1 = ColumnParallelLinear.from_dense(fc1, dims, activation=act, backend=backend, **kw)
        m.fc2 = RowParallelLinear.from_dense(fc2, dims, **kw)
        return m

    @property
    def backend(self) -> str:
        return self.fc1.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, h) -> (b, s, f/tp) -> (b, s, h); under sp (b, s/tp, h) in and out
        fc1, fc2 = self.fc1, self.fc2
        _check_width(x, fc1.in_features, "ParallelMLP",
                     f"hidden={fc1.in_features}, fc1's in_features: every rank takes the whole "
                     "input")
        if fc1.sequence_parallel and x.dim() != 3:
            raise ValueError("ParallelMLP: sequence_parallel expects (batch, seq/tp, hidden) "
                             f"input, got shape {tuple(x.shape)}")
        x, w1, b1, dev = _autocast_operands(x, fc1.weight, fc1.bias)
        _, w2, b2, _ = _autocast_operands(x, fc2.weight, fc2.bias)
        approx = ACTIVATIONS[fc1.activation]
        with torch.autocast(dev, enabled=False):  # the kernels see the cast dtypes
            needs_grad = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (x, w1, b1, w2, b2))
            name = resolve_backend(fc1.backend, x.reshape(-1, x.shape[-1]), w1, b1, approx,
                                   needs_grad)
            fc1.plan.stats.kernel = describe_kernel(name)
            fc2.plan.stats.kernel = (
                "reference: unfused (GEMM, then the GeLU derivative)" if name == "reference"
                else f"{name}: GeLU derivative and fc1's bias gradient fused into the "
                "input-gradient GEMM")
            if name == "reference" and fc1.plan.tp == 1:
                # one device, unfused: autograd's own linear and GeLU nodes compute exactly
                # what the Function would, without its Python in forward and backward
                # (about 1 ms a layer at the tiny preset's 1024 x 128 x 512 on one core)
                for plan in (fc1.plan, fc2.plan):
                    plan.ran("forward", "none")
                    plan.ran("backward", "none")
                return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approx), w2, b2)
            # batch split: fc2's all-reduce may be waited for later, its bias added then
            deferred = None if fc1.sequence_parallel or fc2.plan.tp == 1 else deferring()
            return with_bias(deferred, lambda bias: parallel_mlp(
                x, w1, b1, w2, bias, fc1.plan, fc2.plan, fc1.sequence_parallel, approx, name),
                b2)
