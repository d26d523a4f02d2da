"""Construction pieces of :class:`~distllm.parallel.ZeroOptimizer`: argument checks, the
parameters and param groups it is given, the flat buffers of stages 0-2, and the segments
(each param group's run of a shard) that its inner optimizer steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from distllm.parallel.data.bucket_layout import Bucket

__all__ = ["check_args", "check_meta", "param_groups_of", "pack_bucket", "HALF", "Segment",
           "runs_of", "bucket_order", "shard_segments"]

HALF = (torch.float16, torch.bfloat16)


def check_args(stage: int, optimizer_cls: Any) -> None:
    """Refuse a stage outside 0-3 and an optimizer that is not a ``torch.optim`` class."""
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: choose 0 (plain DP), 1 (shard optimizer states), "
                         "2 (+ gradients) or 3 (+ parameters)")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls={optimizer_cls!r} is not a torch.optim.Optimizer subclass: "
                        "pass the class itself, e.g. torch.optim.AdamW (not an instance)")


def check_meta(module: nn.Module | None, groups: list[tuple[list, dict]], stage: int,
               param_init_fn: Callable | None) -> set[nn.Parameter]:
    """The parameters on the meta device, which only stage 3 with ``param_init_fn``
    materialises (one unit at a time); anything else about them is refused here, before any
    collective, as is a ``param_init_fn`` another stage would ignore."""
    if param_init_fn is not None and stage != 3:
        raise ValueError(f"param_init_fn is read at stage 3 only (here stage={stage}): "
                         "build the model on a real device and leave param_init_fn out")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn={param_init_fn!r}: pass a function (unit, params) "
                        "that fills params in place")
    metas = {p for ps, _ in groups for p in ps if p.is_meta}
    if not metas:
        return metas
    if stage != 3 or param_init_fn is None:
        raise ValueError(
            f"{len(metas)} parameters are on the meta device: stage 3 materialises them one "
            "unit at a time with param_init_fn=(unit, params) -> None filling them; stages "
            "0-2 need the model built on a real device")
    frozen = ([n for n, p in module.named_parameters() if p.is_meta and p not in metas]
              if module is not None else [])
    if frozen:
        raise ValueError(f"parameters {frozen[:3]} are on the meta device but not optimised "
                         "(requires_grad=False, or in none of the param groups), so never "
                         "materialised: build them on a real device")
    bufs = [n for n, b in module.named_buffers() if b.is_meta] if module is not None else []
    if bufs:
        raise ValueError(f"buffers {bufs[:3]} are on the meta device: ZeroOptimizer "
                         "materialises parameters only; create buffers on a real device "
                         "(an explicit device= inside the meta-device context)")
    return metas


def _unname(items: list, names: dict) -> list:
    """Parameters from ``items``; ``(name, param)`` pairs also record the name."""
    out = []
    for it in items:
        if isinstance(it, tuple):
            names[it[1]] = it[0]
            it = it[1]
        out.append(it)
    return out


def param_groups_of(module_or_params, param_groups=None
                  ) -> tuple[nn.Module | None, list[tuple[list, dict]], dict]:
    """``(module, [(params, options), ...], names)`` from a module, parameters, ``(name,
    param)`` pairs (``named_parameters()``), or param-group dicts of either.
    ``param_groups`` goes with a module only (refused otherwise, rather than ignored)."""
    names: dict[nn.Parameter, str] = {}
    if isinstance(module_or_params, nn.Module):
        module = module_or_params
        items = list(param_groups) if param_groups is not None else list(module.parameters())
        names = {p: n for n, p in module.named_parameters()}
    elif param_groups is not None:
        raise ValueError("param_groups= is only read with an nn.Module as module_or_params: "
                         "pass the param-group dicts as module_or_params instead (e.g. "
                         "ZeroOptimizer(groups, ...)), or pass the model with param_groups=")
    else:
        module, items = None, list(module_or_params)
    groups: list[tuple[list, dict]] = []
    if items and isinstance(items[0], dict):
        for i, g in enumerate(items):
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError(f"param group {i} has no 'params': give every group as a "
                                 f"dict with its parameters under 'params', as torch.optim does")
            opts = {k: v for k, v in g.items() if k != "params"}
            ps = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
            groups.append(([p for p in _unname(ps, names) if p.requires_grad], opts))
    else:
        groups.append(([p for p in _unname(items, names) if p.requires_grad], {}))
    if not any(ps for ps, _ in groups):
        raise ValueError("module_or_params has no parameters that require grad: pass the model "
                         "(or its parameters) that holds the weights to optimise")
    allp = [p for ps, _ in groups for p in ps]
    for i, p in enumerate(allp):
        names.setdefault(p, f"param{i}")
    return module, groups, names


@torch.no_grad()
def pack_bucket(b: Bucket, shard: tuple[int, int], param_dtype: torch.dtype,
                master_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Pack ``b``'s parameters into one flat ``param_dtype`` buffer and make each parameter
    a view of it; return ``(flat, master)``. ``master`` is this rank's ``shard = (lo, hi)``
    of the bucket: an fp32 copy when ``master_dtype`` differs (mixed precision), else a view
    of ``flat`` itself (the optimizer then updates the parameters in place)."""
    full = torch.zeros(b.numel, dtype=master_dtype, device=b.params[0].device)
    for p, off in zip(b.params, b.offsets, strict=True):
        full[off: off + p.numel()].copy_(p.detach().reshape(-1))
    mixed = param_dtype != master_dtype
    flat = full.to(param_dtype) if mixed else full
    for p, off in zip(b.params, b.offsets, strict=True):
        p.data = flat[off: off + p.numel()].view_as(p)
    lo, hi = shard
    return flat, full[lo:hi].clone() if mixed else flat[lo:hi]


@dataclass(frozen=True)
class Segment:
    """One tensor the inner optimizer steps: the run ``[lo, hi)`` of master ``bucket``'s
    shard whose parameters are in param group ``group`` (a view of that master, or the
    master itself when its whole shard is one group's)."""

    tensor: Tensor
    bucket: int
    lo: int
    hi: int
    group: int


def runs_of(b, gid: dict) -> list[tuple[int, int, int]]:
    """``(group, start, end)``: the runs of bucket ``b``'s layout whose parameters share a
    param group, tiling ``[0, b.numel)`` (the padding goes with the last run)."""
    runs: list[list[int]] = []
    for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
        g, e = gid[p], off + shape.numel()
        if runs and runs[-1][0] == g:
            runs[-1][2] = e
        else:
            runs.append([g, off, e])
    runs[-1][2] = b.numel
    return [tuple(r) for r in runs]


def bucket_order(module: nn.Module | None, allp: list, gid: dict) -> tuple[list, Callable]:
    """The parameters in the order buckets are filled (reversed there) and the key that
    keeps them apart. With the ``module``, its registration order (backward's, reversed)
    and one stream per dtype: the param groups share buckets (one collective per bucket,
    not per group and bucket), each group's parameters together inside a bucket, so that a
    rank's shard holds one run per group (see :class:`Segment`). Without it the groups'
    order is all there is, and a bucket holding the first group's last parameters and the
    second group's first would wait for both ends of backward: one stream per group."""
    if module is None:
        return allp, lambda p: (gid[p], p.dtype)
    pos = {p: i for i, p in enumerate(module.parameters())}
    return sorted(allp, key=lambda p: pos.get(p, len(pos))), lambda p: p.dtype


def shard_segments(b: Bucket, master: Tensor, shard: tuple[int, int], gid: dict
                   ) -> list[Segment]:
    """What the inner optimizer steps of bucket ``b``: the runs of one param group that this
    rank's slice ``shard`` (``(lo, hi)``) holds, as views of its ``master`` shard (the shard
    itself where one run covers it)."""
    lo, hi = shard
    mine = []
    for g, start, end in runs_of(b, gid):
        a, e = max(start, lo) - lo, min(end, hi) - lo
        if a < e:
            whole = a == 0 and e == master.numel()
            mine.append(Segment(master if whole else master[a:e], b.index, a, e, g))
    return mine
