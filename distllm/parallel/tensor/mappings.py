"""Tensor-parallel mappings: Megatron's f/g operators and the sequence-parallel pairs, in
three tiers.

1. **Primitives** (plain functions, no autograd): :func:`all_reduce_copy`,
   :func:`split_dim`, :func:`all_gather_dim`, :func:`reduce_scatter_dim`.
2. **Autograd functions**, each pairing a forward collective with its backward one:
   ``_CopyToTP`` (identity / all-reduce), ``_ReduceFromTP`` (all-reduce / identity),
   ``_Split`` (split / all-gather), ``_Gather`` (all-gather / split or reduce-scatter),
   ``_ReduceScatter`` (reduce-scatter / all-gather).
3. **Public wrappers**, identities when the group has one rank (or, with no process
   group initialized, when ``group`` is None):

=======================================  ============================  =========================
function                                 forward                       backward
=======================================  ============================  =========================
``copy_to_tp_region`` (f)                identity                      all-reduce
``reduce_from_tp_region`` (g)            all-reduce                    identity
``scatter_to_tp_region``                 split the last dim            all-gather the last dim
``gather_from_tp_region``                all-gather the last dim       split the last dim
``scatter_to_sequence_parallel_region``  split dim 1 (sequence)        all-gather dim 1
``gather_from_sequence_parallel_region`` all-gather dim 1              reduce-scatter dim 1
``reduce_scatter_to_sequence_parallel``  reduce-scatter dim 1          all-gather dim 1
``sync_grad_over_tp``                    identity (on a parameter)     all-reduce of its grad
=======================================  ============================  =========================

``sync_grad_over_tp`` is the f operator applied to a replicated parameter used on a
sequence shard (each rank sees a partial gradient). All take the tensor-parallel ``group``
explicitly. Incoming gradients are never reduced in place (autograd may share a gradient
tensor between two branches, e.g. at a residual add).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distllm.comm.collectives import all_reduce, reduce_scatter
from distllm.comm.compat import all_gather_into

__all__ = [
    "differentiable_once",
    "all_reduce_copy", "split_dim", "all_gather_dim", "reduce_scatter_dim",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
    "gather_from_tp_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel",
    "sync_grad_over_tp",
]

# ---------------------------------------------------------------- 1. primitives


def all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over ``group`` into a new tensor (``x`` is left untouched)."""
    out = x.contiguous().clone()
    all_reduce(out, group=group)
    return out


def split_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (size must divide evenly)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"dimension {dim} of size {size} is not divisible by tp={world}")
    part = x.narrow(dim, rank * (size // world), size // world)
    # a copy even where the slice is already contiguous (dim 1 at batch 1): the shard is a
    # tensor of its own, so an in-place op on it neither trips autograd nor writes into x
    return part.clone(memory_format=torch.contiguous_format)


def all_gather_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x`` (in rank order)."""
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    x = x.movedim(dim, 0).contiguous()  # (n, ...) so that ranks concatenate along dim 0
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum over ranks of ``x``, of which this rank keeps its slice along ``dim`` (``x`` is
    left untouched)."""
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={world}")
    y = x.movedim(dim, 0)  # (world * n, ...): slice r goes to rank r
    # a private copy: on some backends the reduce-scatter writes into its input
    y = y.clone() if y.is_contiguous() else y.contiguous()
    out = torch.empty((y.shape[0] // world, *y.shape[1:]), dtype=y.dtype, device=y.device)
    reduce_scatter(out, y, group=group)
    return out.movedim(0, dim).contiguous()


# ---------------------------------------------------------------- 2. autograd functions


def differentiable_once(backward):
    """A custom Function's ``backward`` that refuses to build a graph (``create_graph=True``):
    the collectives and fused kernels in these backwards are outside autograd's graph, so a
    second derivative through them (a gradient penalty) would come out wrong, silently. One
    error instead, as the backward starts (grad mode is on there only under create_graph)."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            name = type(ctx).__name__.removesuffix("Backward").lstrip("_")
            raise RuntimeError(
                f"{name} is differentiable once: a gradient of its gradient (create_graph=True, "
                f"e.g. a gradient penalty) is not supported, since its backward runs collectives "
                f"or fused kernels outside autograd's graph")
        return backward(ctx, *grads)

    return checked


class _CopyToTP(torch.autograd.Function):
    """f: forward identity; backward all-reduce of the gradient."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, g):
        return all_reduce_copy(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce; backward identity."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, g):
        return g, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's slice along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_dim(x, dim, group)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, g):
        return all_gather_dim(g, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: split (``reduce_grad=False``) or
    reduce-scatter (``reduce_grad=True``: the consumer's gradient is partial per rank)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return all_gather_dim(x, dim, group)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, g):
        if ctx.reduce_grad:
            return reduce_scatter_dim(g, ctx.dim, ctx.group), None, None, None
        return split_dim(g, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @differentiable_once
    def backward(ctx, g):
        return all_gather_dim(g, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------- 3. public wrappers


def _trivial(group: ProcessGroup | None) -> bool:
    if group is None:
        # no process group at all: one process, nothing to communicate. Once one exists,
        # torch would read None as the whole world, which is never what a TP layer means
        if dist.is_available() and dist.is_initialized():
            raise ValueError("the tensor-parallel mappings take the tensor-parallel group "
                             "explicitly (ParallelDims.tp_group); got None")
        return True
    return dist.get_world_size(group) == 1


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f operator: forward identity; backward all-reduce over ``group``."""
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g operator: forward all-reduce over ``group``; backward identity."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: this rank's slice of the last dim; backward: all-gather of the last dim."""
    return x if _trivial(group) else _Split.apply(x, -1, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: all-gather of the last dim; backward: this rank's slice of it."""
    return x if _trivial(group) else _Gather.apply(x, -1, group, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: this rank's slice of dim 1 (sequence); backward: all-gather of dim 1."""
    return x if _trivial(group) else _Split.apply(x, 1, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup,
                                         reduce_grad: bool = True) -> torch.Tensor:
    """Forward: all-gather of dim 1 (sequence); backward: reduce-scatter of dim 1 when the
    consumer is tensor-parallel (``reduce_grad``), else a plain split."""
    return x if _trivial(group) else _Gather.apply(x, 1, group, reduce_grad)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: reduce-scatter of dim 1 (sequence); backward: all-gather of dim 1."""
    return x if _trivial(group) else _ReduceScatter.apply(x, 1, group)


def sync_grad_over_tp(p: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Use of a replicated parameter on a sequence shard: forward identity, backward
    all-reduce of its gradient over ``group`` (so every rank's ``.grad`` is the full one).
    The f operator (:func:`copy_to_tp_region`), named for what it does to a parameter."""
    return p if _trivial(group) else _CopyToTP.apply(p, group)
