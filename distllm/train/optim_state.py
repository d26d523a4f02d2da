"""Per-parameter AdamW moments in a layout-independent form, for checkpoints.

``param_moments(engine, p)`` returns ``{"exp_avg", "exp_avg_sq"}`` of parameter ``p`` as
tensors shaped like ``p`` (this rank's TP shard, complete over DP: ZeRO shards are
all-gathered over the DP group). ``set_moments`` does the reverse from canonical (full)
moments. Both hide whether the optimizer is ``torch.optim.AdamW``, the fp32-master AdamW of
bf16 runs, or a :class:`distllm.parallel.ZeroOptimizer`.
"""

from __future__ import annotations

import torch

from distllm.models.sharding import _shard, _table

__all__ = ["param_moments", "set_moments", "optimizer_step", "sync_params"]


def _torch_optimizer(engine):
    opt = engine.optimizer
    return opt.optimizer if hasattr(opt, "master") else opt


def _key(engine, p: torch.nn.Parameter):
    opt = engine.optimizer
    return opt.master[p] if hasattr(opt, "master") else p


def param_moments(engine, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    if engine.zero is not None:
        return engine.zero.full_param_state(p)
    st = _torch_optimizer(engine).state.get(_key(engine, p), {})
    return {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}


def optimizer_step(engine) -> int:
    """Optimizer steps taken so far (AdamW's ``step``), the same on every rank."""
    if engine.zero is not None:
        return int(engine.zero.step_count())
    for st in _torch_optimizer(engine).state.values():
        if "step" in st:
            return int(st["step"])
    return 0


def sync_params(engine) -> None:
    """Make every module parameter hold its current full (DP-complete) value."""
    if engine.zero is not None and hasattr(engine.zero, "gather_params"):
        engine.zero.gather_params()


@torch.no_grad()
def set_moments(engine, moments: dict, step: int) -> None:
    """``moments``: parameter -> ``(chunk, layer index, canonical name, {key: full tensor})``.
    Installs this rank's shard of each moment and the step count."""
    local: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for p, (chunk, i, name, full) in moments.items():
        kind = _table(chunk.cfg, i)[name][1]
        local[p] = {k: _shard(chunk.cfg, engine.dims, kind, v).clone() for k, v in full.items()}
    if engine.zero is not None:
        engine.zero.load_full_param_state(local, step)
        return
    opt = _torch_optimizer(engine)
    for p, st in local.items():
        key = _key(engine, p)
        dt = key.dtype
        opt.state[key] = {"step": torch.tensor(float(step)),
                          **{k: v.to(dt).reshape(key.shape) for k, v in st.items()}}
