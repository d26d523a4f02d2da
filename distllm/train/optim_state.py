"""Per-parameter weights and AdamW moments of this rank's TP shards, for a run without ZeRO
(``torch.optim.AdamW`` behind DDP): what its checkpoint saves and what a resume or
``--init-from`` installs (:mod:`distllm.train.checkpoint_state`; under ZeRO each rank saves
and loads its own optimizer shard instead, :func:`~distllm.parallel.data.zero_state.
shard_pieces`).

Loaded tensors arrive on the CPU (``torch.distributed.checkpoint`` reads into CPU
targets); :func:`install` puts weights and moments on the device of the parameters they
belong to, and the optimizer step count where the optimizer keeps it
(:func:`~distllm.parallel.data.zero_state.place_step`: on the parameter's device for the
fused AdamW the engine builds).
"""

from __future__ import annotations

import torch
from torch import nn

from distllm.parallel.data.zero_state import place_step

__all__ = ["collect", "install", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def collect(engine, params: list[nn.Parameter]) -> tuple[dict, int]:
    """``({param: {"weight": t, "exp_avg": t, "exp_avg_sq": t}}, optimizer step)`` of a run
    without ZeRO: the parameters and their moments themselves, no copy. Moments are absent
    before the first step."""
    if engine.zero is not None:
        raise ValueError("collect: a ZeRO run's state is its optimizer shard "
                         "(zero_state.shard_pieces)")
    opt = engine.optimizer
    out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    step = 0
    for p in params:
        st = opt.state.get(p, {})
        out[p] = {"weight": p.detach(), **{k: st[k] for k in MOMENTS if k in st}}
        if "step" in st:
            step = int(st["step"])
    return out, step


@torch.no_grad()
def install(engine, local: dict[nn.Parameter, dict[str, torch.Tensor]], step: int) -> None:
    """Set weights (and moments, when given) of a run without ZeRO from per-parameter TP
    shards."""
    if engine.zero is not None:
        raise ValueError("install: a ZeRO run loads its optimizer shard "
                         "(zero_state.shard_targets)")
    opt = engine.optimizer
    for p, d in local.items():
        p.copy_(d["weight"].reshape(p.shape))
        if any(k in d for k in MOMENTS):  # moments beside the parameter
            opt.state[p] = {"step": place_step(opt, p, step),
                            **{k: d[k].to(device=p.device, dtype=p.dtype).reshape(p.shape).clone()
                               for k in MOMENTS if k in d}}
