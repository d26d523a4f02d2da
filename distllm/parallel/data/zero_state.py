"""ZeRO checkpoints: shards gathered into full tensors per parameter name, and back.

``gather_state(z)`` returns::

    {"stage": int, "skipped_steps": int, "loss_scale": float,
     "param_groups": [hyper-parameters of each group, without "params"],
     "master": {name: full fp32 (master dtype) tensor shaped like the parameter},
     "state":  {name: {key: full tensor shaped like the parameter, or the scalar as is}}}

identical on every DP rank (collective: one all-gather over DP per bucket and state key),
so a ``torch.distributed.checkpoint`` save writes each tensor once, and the DP size may
change between save and load. ``load_state`` slices this rank's shard out of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from distllm.comm.buckets import all_gather_flat

__all__ = ["gather_state", "load_state"]


def _full(z, i: int, shard: Tensor) -> Tensor:
    """The whole bucket ``i`` from this rank's ``shard`` (all-gather over DP for stage >= 1)."""
    if z.stage == 0 or z.nranks == 1:
        return shard.detach().clone()
    out = torch.empty(shard.numel() * z.nranks, dtype=shard.dtype, device=shard.device)
    all_gather_flat(out, shard.detach().contiguous(), z.group)
    return out


def _split(z, i: int, full: Tensor) -> dict[str, Tensor]:
    b = z.reducer.buckets[i]
    return {z.names[p]: full[off: off + shape.numel()].view(shape).clone()
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True)}


def _is_elementwise(v: Any, m: Tensor) -> bool:
    return isinstance(v, Tensor) and v.shape == m.shape and v.dim() > 0


@torch.no_grad()
def gather_state(z) -> dict[str, Any]:
    master: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for i, m in enumerate(z.masters):
        master.update(_split(z, i, _full(z, i, m)))
        st = z.optimizer.state.get(m, {})
        names = [z.names[p] for p in z.reducer.buckets[i].params]
        for n in names:
            state[n] = {}
        for key in sorted(st):
            v = st[key]
            if _is_elementwise(v, m):
                for n, t in _split(z, i, _full(z, i, v)).items():
                    state[n][key] = t
            else:
                for n in names:
                    state[n][key] = v.clone() if isinstance(v, Tensor) else v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in z.optimizer.param_groups]
    return {"stage": z.stage, "skipped_steps": z.skipped_steps, "loss_scale": z.loss_scale,
            "param_groups": groups, "master": master, "state": state}


def _my_slice(z, i: int, per_param: dict[str, Tensor], like: Tensor) -> Tensor:
    """This rank's shard of bucket ``i`` assembled from full per-parameter tensors."""
    b = z.reducer.buckets[i]
    full = torch.zeros(b.numel, dtype=like.dtype, device=like.device)
    for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
        full[off: off + shape.numel()].copy_(per_param[z.names[p]].reshape(-1))
    lo, hi = z._shard_range(b.numel)
    return full[lo:hi]


@torch.no_grad()
def load_state(z, sd: dict[str, Any]) -> None:
    missing = [z.names[p] for p in z.reducer.params() if z.names[p] not in sd["master"]]
    if missing:
        raise KeyError(f"state dict lacks master weights for {missing[:5]} (a different model?)")
    for i, m in enumerate(z.masters):
        m.copy_(_my_slice(z, i, sd["master"], m))
        names = [z.names[p] for p in z.reducer.buckets[i].params]
        keys = sd["state"].get(names[0], {})
        st = z.optimizer.state[m]
        for key, v in keys.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                per = {n: sd["state"][n][key] for n in names}
                st[key] = _my_slice(z, i, per, v).clone()
            else:
                st[key] = v.clone() if isinstance(v, Tensor) else v
    for g, saved in zip(z.optimizer.param_groups, sd["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
    z.skipped_steps = int(sd.get("skipped_steps", 0))
    z.loss_scale = float(sd.get("loss_scale", z.loss_scale))
    z._publish()
