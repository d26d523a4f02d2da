"""Megatron-style ``ColumnParallelLinear`` and ``RowParallelLinear``, the modules users build
models from; their GEMMs with communication (overlapped by the engines) are in
:mod:`distllm.parallel.tensor.layers`.

Each layer has ``overlap_stats`` (:class:`distllm.parallel.tensor.layers.OverlapStats`): per
direction (``forward`` / ``backward``) the collective that ran, the calls, how many ran an
overlapped schedule, the last mode and chunk count, the host time blocked on collectives
(``wait_ms``), and, with ``overlap="auto"``, the measured standalone communication time
(``comm_ms_est``) from which ``hidden_ms`` and ``hidden_frac`` estimate how much
communication was hidden (on CPU ranks: on CUDA the stream waits, not the host, and they are
None; ``distllm bench --doctor`` reads what hid from a profiler trace).
``overlap_stats.reset()`` clears.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distllm.dtypes import autocast_cast
from distllm.parallel.tensor.batch_split import deferring, with_bias
from distllm.parallel.tensor.fused_mlp import (
    BACKENDS,
    column_parallel_linear_gelu,
    describe_kernel,
    resolve_backend,
)
from distllm.parallel.tensor.layers import (
    OverlapPlan,
    OverlapStats,
    column_parallel_matmul,
    row_parallel_matmul,
)
from distllm.parallel.tensor.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from distllm.parallel.tensor.sharding import (
    check_divisible,
    init_full_weight,
    mark_tensor_parallel,
    shard,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ACTIVATIONS", "scatter_sequence",
           "gather_sequence"]

ACTIVATIONS = {None: None, "gelu": "none", "gelu_tanh": "tanh"}


def _check_sp_input(x: torch.Tensor, tp: int, sp: bool, what: str) -> None:
    if sp and x.dim() != 3:
        raise ValueError(f"{what}: sequence_parallel expects (batch, seq, hidden) input, got "
                         f"shape {tuple(x.shape)}")


def _check_width(x: torch.Tensor, want: int, what: str, why: str) -> None:
    """ValueError, before any collective, unless ``x``'s last dim is ``want`` features."""
    if x.dim() == 0 or x.shape[-1] != want:
        raise ValueError(f"{what}: input of shape {tuple(x.shape)} has "
                         f"{x.shape[-1] if x.dim() else 0} features, expected {want} ({why})")


class ColumnParallelLinear(nn.Module):
    """``Y = act(X W^T + b)`` with ``W``'s output rows split over tp: rank ``r`` holds
    ``W[r*out/tp:(r+1)*out/tp]`` and produces that slice of ``Y``.

    Collectives: forward none (``sequence_parallel``: all-gather of X along the sequence,
    chunk by chunk overlapped with the GEMM; ``gather_output``: all-gather of Y's last dim);
    backward all-reduce of dX overlapped with the dW GEMM (``sequence_parallel``:
    reduce-scatter of dX along the sequence, likewise overlapped).

    ``activation`` "gelu" / "gelu_tanh": the GEMM is fused with the bias and the GeLU in every
    mode (:mod:`distllm.parallel.tensor.fused_mlp`): the fused op on the local input, or, under
    sequence parallelism, on each all-gathered chunk as it arrives, the pre-activation kept
    for the backward; the backward's input-gradient collective still overlaps the
    weight-gradient GEMM. ``backend`` ("auto", "cuda", "triton", "cpu", "reference") pins
    what computes it, as :func:`distllm.ops.linear_gelu`'s does; "auto" times the candidates
    (the unfused "reference" among them) once per shape, and ``overlap_stats.kernel`` says
    which ran.

    Under ``sequence_parallel`` the gathered full-sequence input is kept for the weight
    gradient (no second all-gather in backward, at the cost of ``tp`` times the shard's
    memory). The full weight is initialised identically on every rank (same seed) and then
    sharded, so the model does not depend on tp.
    """

    def __init__(self, in_features: int, out_features: int, dims, bias: bool = True,
                 gather_output: bool = False, activation: str | None = None,
                 sequence_parallel: bool = False, dtype=None, device=None,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 overlap: str = "auto", chunks: int = 4, backend: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: use None, 'gelu' or 'gelu_tanh'")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)}")
        self.backend = backend
        check_divisible(out_features, dims.tp, "out_features", "out_features")
        self.in_features, self.out_features, self.dims = in_features, out_features, dims
        self.gather_output, self.activation = gather_output, activation
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.plan = OverlapPlan(dims, overlap, chunks, "ColumnParallelLinear")
        full = init_full_weight((out_features, in_features), in_features, init_method, dtype,
                                device)
        self.weight = mark_tensor_parallel(
            nn.Parameter(shard(full, 0, dims.tp_rank, dims.tp)), 0)
        self.bias = None
        if bias:
            fb = init_full_weight((out_features,), in_features, None, dtype, device)
            self.bias = mark_tensor_parallel(nn.Parameter(shard(fb, 0, dims.tp_rank, dims.tp)), 0)

    @property
    def overlap_stats(self) -> OverlapStats:
        return self.plan.stats

    @classmethod
    def from_dense(cls, linear: nn.Linear, dims, **kwargs) -> ColumnParallelLinear:
        """Shard a dense ``nn.Linear``'s output rows; ``kwargs`` as the constructor's (its
        ``dtype`` and ``device`` by default)."""
        kwargs = {"dtype": linear.weight.dtype, "device": linear.weight.device, **kwargs}
        m = cls(linear.in_features, linear.out_features, dims, bias=linear.bias is not None,
                **kwargs)
        with torch.no_grad():
            m.weight.copy_(shard(linear.weight, 0, dims.tp_rank, dims.tp))
            if m.bias is not None:
                m.bias.copy_(shard(linear.bias, 0, dims.tp_rank, dims.tp))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, group = self.dims.tp, self.dims.tp_group
        _check_width(x, self.in_features, "ColumnParallelLinear",
                     f"in_features={self.in_features}: every rank takes the whole input")
        _check_sp_input(x, tp, self.sequence_parallel, "ColumnParallelLinear")
        approx = ACTIVATIONS[self.activation]
        if approx is not None:
            y = self._fused(x, approx)
        elif tp > 1 and (self.sequence_parallel or self.plan.overlap != "none"):
            x, w, b, dev = _autocast_operands(x, self.weight, self.bias)
            with torch.autocast(dev, enabled=False):  # the engines see the cast dtypes
                y = column_parallel_matmul(x, w, b, self.plan, self.sequence_parallel)
        else:
            self.plan.ran("forward", "none")
            if torch.is_grad_enabled():
                self.plan.ran("backward", "all_reduce" if tp > 1 and x.requires_grad else "none")
            x = copy_to_tp_region(x, group)  # f: backward all-reduce of dX
            y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp_region(y, group)
        return y

    def _fused(self, x: torch.Tensor, approx: str) -> torch.Tensor:
        """The GEMM + bias + GeLU through the fused path of this layer's mode."""
        x, w, b, dev = _autocast_operands(x, self.weight, self.bias)
        with torch.autocast(dev, enabled=False):  # the kernels see the cast dtypes
            needs_grad = torch.is_grad_enabled() and (
                x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
            name = resolve_backend(self.backend, x.reshape(-1, x.shape[-1]), w, b, approx,
                                   needs_grad)
            self.plan.stats.kernel = describe_kernel(name)
            if self.dims.tp == 1:
                from distllm.ops import linear_gelu

                self.plan.ran("forward", "none")
                if needs_grad:
                    self.plan.ran("backward", "none")
                return linear_gelu(x, w, b, approximate=approx, backend=name)
            return column_parallel_linear_gelu(x, w, b, self.plan, self.sequence_parallel,
                                               approx, name)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}/tp={self.dims.tp}, "
                f"activation={self.activation}, sp={self.sequence_parallel}, "
                f"overlap={self.plan.overlap}, chunks={self.plan.chunks}, "
                f"backend={self.backend}")


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s input columns split over tp: rank ``r`` holds
    ``W[:, r*in/tp:(r+1)*in/tp]`` and its slice of X's features; ``b`` is replicated.

    Collectives: forward all-reduce of the partial Y, chunked along the rows (tokens) and
    overlapped with the GEMM (``sequence_parallel``: reduce-scatter along the sequence,
    likewise); backward none (``sequence_parallel``: all-gather of dY along the sequence
    overlapped with the dX GEMM, and an all-reduce of the bias gradient).
    ``input_is_parallel=False``: X is full and split here (backward: all-gather of dX).

    ``overlap``: "chunked" uses ``chunks`` pieces (from 3 on, the first and the last half
    the size of the others, so that the collective starts early and ends soon), "none" the
    sequential GEMM then collective, "auto" the faster of them by a cached measurement per
    shape (logging once to ``logging.getLogger("distllm")`` when it falls back to none).
    """

    def __init__(self, in_features: int, out_features: int, dims, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 overlap: str = "auto", chunks: int = 4, dtype=None, device=None,
                 init_method: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        check_divisible(in_features, dims.tp, "in_features", "in_features")
        self.in_features, self.out_features, self.dims = in_features, out_features, dims
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.plan = OverlapPlan(dims, overlap, chunks, "RowParallelLinear")
        full = init_full_weight((out_features, in_features), in_features, init_method, dtype,
                                device)
        self.weight = mark_tensor_parallel(
            nn.Parameter(shard(full, 1, dims.tp_rank, dims.tp)), 1)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(init_full_weight((out_features,), in_features, None, dtype,
                                                      device))
            if self.sequence_parallel:
                self.bias.sequence_parallel = True  # its grad is all-reduced inside backward

    @property
    def overlap_stats(self) -> OverlapStats:
        return self.plan.stats

    @classmethod
    def from_dense(cls, linear: nn.Linear, dims, **kwargs) -> RowParallelLinear:
        """Shard a dense ``nn.Linear``'s input columns; ``kwargs`` as the constructor's (its
        ``dtype`` and ``device`` by default)."""
        kwargs = {"dtype": linear.weight.dtype, "device": linear.weight.device, **kwargs}
        m = cls(linear.in_features, linear.out_features, dims, bias=linear.bias is not None,
                **kwargs)
        with torch.no_grad():
            m.weight.copy_(shard(linear.weight, 1, dims.tp_rank, dims.tp))
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, group = self.dims.tp, self.dims.tp_group
        self._check_input(x)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, group)
        _check_sp_input(x, tp, self.sequence_parallel, "RowParallelLinear")
        if self.sequence_parallel and x.shape[1] % tp:
            raise ValueError(f"RowParallelLinear: sequence length {x.shape[1]} is not divisible "
                             f"by tp={tp}: choose seq_len a multiple of {tp} under "
                             "sequence_parallel=True")
        if tp == 1:
            self.plan.ran("forward", "none")
            if torch.is_grad_enabled():
                self.plan.ran("backward", "none")
            return F.linear(x, self.weight, self.bias)
        x, w, b, dev = _autocast_operands(x, self.weight, self.bias)
        deferred = None if self.sequence_parallel else deferring()  # batch split
        with torch.autocast(dev, enabled=False):  # the engines see the cast dtypes
            return with_bias(deferred, lambda bias: row_parallel_matmul(
                x, w, bias, self.plan, self.sequence_parallel), b)

    def _check_input(self, x: torch.Tensor) -> None:
        n, tp = self.in_features, self.dims.tp
        if self.input_is_parallel:
            _check_width(x, n // tp, "RowParallelLinear",
                         f"in_features={n} / tp={tp} with input_is_parallel=True; for the full "
                         f"{n}-feature input use input_is_parallel=False")
        else:
            _check_width(x, n, "RowParallelLinear",
                         f"in_features={n} with input_is_parallel=False; for an input already "
                         f"split over tp ({n // tp} features) use input_is_parallel=True")

    def extra_repr(self) -> str:
        return (f"in={self.in_features}/tp={self.dims.tp}, out={self.out_features}, "
                f"sp={self.sequence_parallel}, overlap={self.plan.overlap}, "
                f"chunks={self.plan.chunks}")


def _autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``(x, weight, bias, device_type)`` as ``F.linear`` would see them under autocast: on
    an autocast-enabled device, floating operands other than float64 go to its dtype (the
    cast is differentiable, so gradients reach the float32 parameters); otherwise as given.
    The overlap engines' GEMMs write into preallocated outputs, which autocast cannot cast."""
    dev = x.device.type if x.device.type in ("cpu", "cuda") else "cpu"
    if not torch.is_autocast_enabled(dev):
        return x, weight, bias, dev
    dtype = torch.get_autocast_dtype(dev)
    return (*(autocast_cast(t, dev, dtype) for t in (x, weight, bias)), dev)


def gather_sequence(x: torch.Tensor, dims) -> torch.Tensor:
    """Full sequence from sequence shards (forward all-gather, backward split): for
    inspecting or returning activations of a sequence-parallel region."""
    return gather_from_sequence_parallel_region(x, dims.tp_group, reduce_grad=False)


def scatter_sequence(x: torch.Tensor, dims) -> torch.Tensor:
    """This rank's sequence shard of ``(batch, seq, hidden)`` (forward split along dim 1,
    backward all-gather): the entry into a sequence-parallel region."""
    if dims.tp > 1 and (x.dim() < 2 or x.shape[1] % dims.tp):
        raise ValueError(f"sequence length {x.shape[1] if x.dim() > 1 else None} is not "
                         f"divisible by tp={dims.tp}: choose seq_len a multiple of {dims.tp} "
                         "under sequence_parallel=True (or turn sequence_parallel off)")
    return scatter_to_sequence_parallel_region(x, dims.tp_group)
