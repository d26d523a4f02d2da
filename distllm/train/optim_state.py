"""Per-parameter weights and AdamW moments in a layout-independent form, for checkpoints.

:func:`collect` returns, per parameter of this rank, ``{"weight", "exp_avg", "exp_avg_sq"}``
shaped like the parameter's TP shard and complete over DP (ZeRO shards gathered; ``weight``
is the fp32 master under mixed precision). :func:`install` does the reverse. Both hide
whether the optimizer is ``torch.optim.AdamW`` behind DDP or a
:class:`distllm.parallel.ZeroOptimizer` (whose ``state_dict`` already holds full tensors
keyed ``master.<name>`` / ``state.<name>.<key>``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["collect", "install", "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_names(engine) -> dict[nn.Parameter, str]:
    return engine.zero.names


@torch.no_grad()
def collect(engine, params: list[nn.Parameter]) -> tuple[dict, int]:
    """``({param: {"weight": t, "exp_avg": t, "exp_avg_sq": t}}, optimizer step)``;
    collective over DP with ZeRO. Moments are absent before the first step."""
    out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    if engine.zero is not None:
        sd = engine.zero.state_dict()
        names = _zero_names(engine)
        step = 0
        for p in params:
            n = names[p]
            d = {"weight": sd[f"master.{n}"].reshape(p.shape)}
            for k in MOMENTS:
                if f"state.{n}.{k}" in sd:
                    d[k] = sd[f"state.{n}.{k}"].reshape(p.shape)
            if f"state.{n}.step" in sd:
                step = int(sd[f"state.{n}.step"])
            out[p] = d
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
        sd = engine.zero.state_dict()  # the template: every key, right dtypes
        for p, d in local.items():
            n = names[p]
            for k, v in d.items():
                key = f"master.{n}" if k == "weight" else f"state.{n}.{k}"
                if key in sd:
                    sd[key] = v.to(sd[key].dtype).reshape(sd[key].shape)
                elif k != "weight":
                    sd[key] = v.to(engine.zero.master_dtype).clone()
            if any(k in d for k in MOMENTS):
                sd[f"state.{n}.step"] = torch.tensor(float(step))
        engine.zero.load_state_dict(sd)
        return
    opt = engine.optimizer
    for p, d in local.items():
        p.copy_(d["weight"].reshape(p.shape))
        if any(k in d for k in MOMENTS):
            opt.state[p] = {"step": torch.tensor(float(step)),
                            **{k: d[k].to(p.dtype).reshape(p.shape).clone()
                               for k in MOMENTS if k in d}}
