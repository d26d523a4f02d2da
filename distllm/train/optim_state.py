"""Per-parameter weights and AdamW moments of this rank's TP shards: what a checkpoint of a
run without ZeRO saves (:mod:`distllm.train.checkpoint_state`; under ZeRO each rank saves
its own optimizer shard instead) and what ``--init-from`` installs.

:func:`collect` returns, per parameter of this rank, ``{"weight", "exp_avg", "exp_avg_sq"}``
shaped like the parameter's TP shard and complete over DP (ZeRO shards gathered; ``weight``
is the fp32 master under mixed precision). :func:`install` does the reverse. Both hide
whether the optimizer is ``torch.optim.AdamW`` behind DDP or a
:class:`distllm.parallel.ZeroOptimizer` (whose ``state_dict`` already holds full tensors
keyed ``master.<name>`` / ``state.<name>.<key>``).

Loaded tensors arrive on the CPU (``torch.distributed.checkpoint`` reads into CPU
targets); :func:`install` puts weights and moments on the device of the parameters (or
ZeRO masters) they belong to, and the optimizer step count where the optimizer keeps it
(:func:`~distllm.parallel.data.zero_state.place_step`: on the parameter's device for the
fused AdamW the engine builds).
"""

from __future__ import annotations

import torch
from torch import nn

from distllm.parallel.data.zero_state import place_step

__all__ = ["collect", "install", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_names(engine) -> dict[nn.Parameter, str]:
    return engine.zero.names


@torch.no_grad()
def collect(engine, params: list[nn.Parameter]) -> tuple[dict, int]:
    """``({param: {"weight": t, "exp_avg": t, "exp_avg_sq": t}}, optimizer step)``;
    collective over DP with ZeRO, whose full tensors come on the CPU (the whole state at once
    would not fit the GPU of a model ZeRO made fit). Moments are absent before the first
    step."""
    out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    if engine.zero is not None:
        # {"master": {name: t}, "state": {name: {key: t}}}
        sd = engine.zero.state_dict(device="cpu")
        names = _zero_names(engine)
        step = 0
        for p in params:
            n = names[p]
            st = sd["state"].get(n, {})
            out[p] = {"weight": sd["master"][n], **{k: st[k] for k in MOMENTS if k in st}}
            if "step" in st:
                step = int(st["step"])
        return out, step
    opt = engine.optimizer
    step = 0
    for p in params:
        st = opt.state.get(p, {})
        out[p] = {"weight": p.detach(), **{k: st[k] for k in MOMENTS if k in st}}
        if "step" in st:
            step = int(st["step"])
    return out, step


@torch.no_grad()
def install(engine, local: dict[nn.Parameter, dict[str, torch.Tensor]], step: int) -> None:
    """Set weights (and moments, when given) from per-parameter TP shards."""
    if engine.zero is not None:
        names = _zero_names(engine)
        sd = engine.zero.state_dict(device="cpu")  # the template: every key, right dtypes
        for p, d in local.items():
            n = names[p]
            like = sd["master"][n]  # full, on the CPU (the load copies a bucket at a time)
            put = dict(device=like.device, dtype=like.dtype)
            sd["master"][n] = d["weight"].to(**put).reshape(like.shape)
            if any(k in d for k in MOMENTS):
                sd["state"][n] = {"step": torch.tensor(float(step)),  # placed by the ZeRO load
                                  **{k: d[k].to(**put).reshape(like.shape)
                                     for k in MOMENTS if k in d}}
        engine.zero.load_state_dict(sd)
        return
    opt = engine.optimizer
    for p, d in local.items():
        p.copy_(d["weight"].reshape(p.shape))
        if any(k in d for k in MOMENTS):  # moments beside the parameter
            opt.state[p] = {"step": place_step(opt, p, step),
                            **{k: d[k].to(device=p.device, dtype=p.dtype).reshape(p.shape).clone()
                               for k in MOMENTS if k in d}}
