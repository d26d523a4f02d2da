"""Global gradient-norm clipping across DP shards, TP and PP groups.

The global norm is the norm of the whole model's gradient, one copy of each weight:

* a parameter with ``tensor_model_parallel = True`` is split over the TP group: the
  squared norms of its pieces are summed over TP;
* a parameter without it is replicated over TP: it is counted once (on TP rank 0); another
  TP rank's copy adds zero times its norm, which is NaN where that copy is inf/NaN, so a
  fault in any one copy reaches the norm every rank reads;
* pipeline stages hold disjoint parameters: the squared norms are summed over PP;
* ZeRO shards (each DP rank holds a disjoint slice) are summed over DP; full, replicated
  gradients (DDP, ZeRO-0/1 before sharding) are not.

So one all-reduce (sum; max for ``inf``) runs over the model-parallel group (pp x tp), or
over the world group when the gradients are DP shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from distllm.comm.collectives import all_reduce

__all__ = ["clip_grad_norm_", "clip_grad_norm_and_sum_", "norm_and_sums", "global_norm",
           "local_norm", "is_tp_sharded", "all_finite"]


def is_tp_sharded(p: Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if norm_type != 2.0 and norm_type != float("inf"):
        raise ValueError(f"norm_type={norm_type}: only 2.0 and inf are supported")
    return norm_type


def local_norm(pieces: Iterable[tuple[Tensor, bool]], *, dims,
               norm_type: float = 2.0) -> Tensor:
    """This rank's share of the global norm of gradient ``pieces`` = ``(tensor,
    tp_sharded)``: the sum of their squares (``norm_type=2``) or their largest magnitude
    (``inf``), a float64 scalar on their device (the mesh's device when this rank holds
    none). A replicated piece counts on TP rank 0 only; on another TP rank it adds zero times
    its norm, nothing unless it is inf/NaN there (then NaN). Nothing is communicated.

    One ``torch._foreach_norm`` per dtype and device, whatever the number of pieces: each
    piece's norm in the gradient's precision (float32 for half types: a float64 reduction
    of float32 input runs 30-60x slower on CPU), squared and summed in float64. NaN and inf
    propagate into the result."""
    norm_type = _check_norm_type(norm_type)
    count_replicated = dims is None or dims.tp_rank == 0
    groups: dict[tuple[torch.dtype, torch.device, bool], list[Tensor]] = {}
    for g, tp_sharded in pieces:
        if g.numel() == 0:
            continue
        groups.setdefault((g.dtype, g.device, tp_sharded or count_replicated), []
                          ).append(g.detach())
    if not groups:  # nothing here; the collective still needs this rank's zero, on the
        # mesh's device (without a mesh nothing is reduced: one process, on the CPU)
        device = dims.device if dims is not None else torch.device("cpu")
        return torch.zeros((), dtype=torch.float64, device=device)
    parts, dev = [], next(iter(groups))[1]
    for (dtype, _, counted), gs in groups.items():
        red = torch.float64 if dtype == torch.float64 else torch.float32
        norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=red)).to(torch.float64)
        part = (norms.square().sum() if norm_type == 2.0 else norms.max()).to(dev)
        parts.append(part if counted else part * 0)  # 0 * inf is NaN
    total = torch.stack(parts)
    return total.sum() if norm_type == 2.0 else total.max()


def global_norm(pieces: Iterable[tuple[Tensor, bool]], *, dims, norm_type: float = 2.0,
                dp_sharded: bool = False) -> Tensor:
    """Global norm of gradient ``pieces`` = ``(tensor, tp_sharded)`` held by this rank.

    Collective: one all-reduce over ``dims.model_parallel_group`` (or the world group
    when ``dp_sharded``); returns a float64 scalar tensor on the gradients' device (the
    mesh's device when this rank holds none), the same on every rank. No host sync. An
    inf/NaN gradient anywhere makes it non-finite on every rank (the ``inf`` norm of a
    NaN reduced over ranks reads inf).
    """
    norm_type = _check_norm_type(norm_type)
    acc = local_norm(pieces, dims=dims, norm_type=norm_type)
    if dims is not None:
        group = dims.world_group if dp_sharded else dims.model_parallel_group
        if dist.get_world_size(group) > 1:
            if norm_type == 2.0:
                all_reduce(acc, group=group)
            else:
                # a backend's MAX may drop NaN (gloo's ring does: max(0, NaN) = 0), so a NaN
                # term goes in as inf and the fault still reaches every rank's norm
                acc = torch.where(acc.isnan(), torch.full_like(acc, float("inf")), acc)
                all_reduce(acc, group=group, op=dist.ReduceOp.MAX)
    return acc.sqrt() if norm_type == 2.0 else acc


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, *, dims,
                    norm_type: float = 2.0) -> Tensor:
    """Clip the (DP-synchronised, full) gradients of ``parameters`` in place so that the
    global norm over TP and PP is at most ``max_norm``; returns the norm before clipping
    (a float64 scalar on the gradients' device; no host sync).

    Use it with :class:`~distllm.parallel.DistributedDataParallel` (after backward) or with
    plain replicated data parallelism; for ZeRO use ``ZeroOptimizer.clip_grad_norm_``.
    A non-finite norm leaves the gradients untouched.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_norm(((p.grad, is_tp_sharded(p)) for p in params), dims=dims,
                       norm_type=norm_type)
    clip_by(norm, max_norm, [p.grad for p in params])
    return norm


def norm_and_sums(sq: Tensor, extras: Iterable[Tensor], group) -> tuple[Tensor, Tensor]:
    """One all-reduce (sum) over ``group`` of this rank's share of the squared 2-norm ``sq``
    and of ``extras`` (this rank's values, as float64): the global norm and the summed
    extras as one float64 vector, on ``sq``'s device (no host sync)."""
    vec = torch.cat([sq.reshape(1).to(torch.float64),
                     *(e.to(device=sq.device, dtype=torch.float64).reshape(-1) for e in extras)])
    if dist.get_world_size(group) > 1:
        all_reduce(vec, group=group)
    return vec[0].sqrt(), vec[1:]


def clip_grad_norm_and_sum_(parameters: Iterable[Tensor], max_norm: float, *, dims,
                            extra: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`clip_grad_norm_` (2-norm) whose one all-reduce, over the world group, also sums
    ``extra`` (a float64 vector on the mesh's device, e.g. a loss share) over every rank:
    the step's metrics and the norm in one collective. The gradients must be the same on
    every DP replica (after DDP's all-reduce), so only DP rank 0's squares count (another
    replica's add zero, or NaN where its copy is inf/NaN, as TP's replicas do). Returns
    (the norm before clipping, the summed ``extra``); no host sync."""
    params = [p for p in parameters if p.grad is not None]
    sq = local_norm(((p.grad, is_tp_sharded(p)) for p in params), dims=dims)
    if dims.dp_rank != 0:
        sq = sq * 0  # zero, or NaN where this replica's gradient is inf/NaN
    norm, summed = norm_and_sums(sq, [extra], dims.world_group)
    clip_by(norm, max_norm, [p.grad for p in params])
    return norm, summed


def clip_by(norm: Tensor, max_norm: float, grads: Iterable[Tensor]) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (norm + 1e-6))`` (torch's formula), on the
    device: no host sync. A non-finite ``norm`` scales by 1 (the gradients stay as they
    are, and the optimizer's inf/NaN check decides whether the step happens); so does
    ``max_norm = inf`` (nothing to clip; nothing is launched)."""
    max_norm = float(max_norm)
    if max_norm == float("inf"):
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    for (dtype, device), gs in groups.items():
        # the coefficient in the dtype the multiply computes in (fp32 for half gradients)
        op_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        torch._foreach_mul_(gs, coef.to(device=device, dtype=op_dtype))


def all_finite(g: Tensor) -> Tensor:
    """Whether every element of ``g`` is finite, as a bool scalar on its device: one read
    of ``g`` for its smallest and largest element (``aminmax`` propagates NaN, and an inf is
    one of the two), nothing written of ``g``'s size, no overflow whatever the dtype. (A
    float64 sum of float32 input, or ``isfinite(g).all()``, each cost 15-20x more on CPU.)"""
    if g.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=g.device)
    lo, hi = torch.aminmax(g)
    return torch.isfinite(lo) & torch.isfinite(hi)
