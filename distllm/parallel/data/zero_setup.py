"""Argument checks and parameter collection for :class:`~distllm.parallel.ZeroOptimizer`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distllm.parallel.mesh import ParallelDims

__all__ = ["check_args", "param_groups_of", "broadcast_params", "HALF"]

HALF = (torch.float16, torch.bfloat16)


def check_args(stage: int, optimizer_cls: Any) -> None:
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: choose 0 (plain DP), 1 (shard optimizer states), "
                         "2 (+ gradients) or 3 (+ parameters)")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls={optimizer_cls!r} is not a torch.optim.Optimizer subclass: "
                        "pass the class itself, e.g. torch.optim.AdamW (not an instance)")


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
    param)`` pairs (``named_parameters()``), or param-group dicts of either."""
    names: dict[nn.Parameter, str] = {}
    if isinstance(module_or_params, nn.Module):
        module = module_or_params
        items = list(param_groups) if param_groups is not None else list(module.parameters())
        names = {p: n for n, p in module.named_parameters()}
    else:
        module, items = None, list(module_or_params)
    groups: list[tuple[list, dict]] = []
    if items and isinstance(items[0], dict):
        for g in items:
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
def broadcast_params(groups, dims: ParallelDims) -> None:
    src = dims.group_ranks("dp")[0]
    for ps, _ in groups:
        for p in ps:
            dist.broadcast(p.data, src=src, group=dims.dp_group)

