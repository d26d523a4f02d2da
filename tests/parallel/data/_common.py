"""Shared pieces of the data-parallel tests (DDP, ZeRO, buckets): a small odd-sized model,
its batches, the trainer's default optimizer settings, one reference-checked training step,
and a cache of spawned runs (one spawn per rank function and world size, each scenario its
own test)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distllm.train.config import OptimConfig, TrainConfig
from distllm.train.trainer import lr_at
from tests._errors import worst
from tests._models import Block

TOL = 1e-10  # float64 parity: only summation order differs

OPT = OptimConfig()  # the trainer's defaults: AdamW, weight decay, clipping, warm-up
SCHEDULE = TrainConfig(steps=60)  # the default warm-up (5%: the first 3 steps) of a 60-step run


class Net(nn.Module):
    """A tiny GPT-like stack with odd sizes (so buckets need padding)."""

    def __init__(self, d_in: int = 7, h: int = 13, f: int = 23, n: int = 3, out: int = 5,
                 unused: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, h)
        self.blocks = nn.ModuleList(Block(h, f) for _ in range(n))
        self.head = nn.Linear(h, out)
        self.extra = nn.Linear(h, out) if unused else None  # used on DP rank 0 only
        self.never = nn.Parameter(torch.ones(3)) if unused else None  # never used

    def forward(self, x, use_extra: bool = False):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        y = self.head(x)
        if use_extra:
            y = y + self.extra(x)
        return y


def make(seed: int = 0, dtype=torch.float64, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw).to(dtype)


def batch(step: int, n: int = 8, d_in: int = 7, out: int = 5):
    g = torch.Generator().manual_seed(100 + step)
    # 3-D input (b, s, d): the layers see (8, 3, 7)
    return (torch.randn(n, 3, d_in, generator=g, dtype=torch.float64),
            torch.randn(n, 3, out, generator=g, dtype=torch.float64))


def local(t, dims):
    n = t.shape[0] // dims.dp
    return t[dims.dp_rank * n: (dims.dp_rank + 1) * n]


def loss_fn(model, x, y, **kw):
    return (model(x, **kw) - y).pow(2).mean()


def adamw(**over: Any) -> dict:
    """The trainer's AdamW hyper-parameters (weight decay is per group: see groups_of)."""
    return {"lr": OPT.lr, "betas": (OPT.beta1, OPT.beta2), "eps": OPT.eps, **over}


def groups_of(model: nn.Module, named: bool = False) -> list[dict]:
    """The trainer's param groups: weight decay on matrices, none on biases and norms."""
    from distllm.train.engine import _decay_groups

    items = list(model.named_parameters())
    groups = _decay_groups(items, OPT.weight_decay)
    if named:
        name = {p: n for n, p in items}
        for g in groups:
            g["params"] = [(name[p], p) for p in g["params"]]
    return groups


def set_lr(step: int, *optimizers, base: float = OPT.lr) -> None:
    """The trainer's schedule (warm-up then cosine) at ``step``, scaled to peak ``base``."""
    lr = base * lr_at(step, SCHEDULE) / OPT.lr
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = lr


def train_step(z, ropt, model, ref, dims, step: int, *, base_lr: float = OPT.lr,
               clip: float = OPT.grad_clip) -> tuple[float, float]:
    """One step as the trainer takes it (scheduled lr, clip by the global norm, step) of the
    ZeRO model on this rank's rows and of the single-process reference on the global batch;
    returns both gradient norms before clipping."""
    set_lr(step, z, ropt, base=base_lr)
    x, y = batch(step)
    z.zero_grad()
    loss_fn(model, local(x, dims), local(y, dims)).backward()
    ropt.zero_grad()
    loss_fn(ref, x, y).backward()
    n1 = z.clip_grad_norm_(clip)
    n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    z.step()
    ropt.step()
    return n1.item(), n2.item()


def max_err(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return worst((a[k] - b[k]).abs().max().item() for k in a)


