"""Data parallelism on CUDA tensors in a 1-rank NCCL world: DDP and ZeRO-0/1/2/3 with
global-norm clipping, and loss scaling (a constant scale, and the dynamic scale skipping a
step with an inf gradient), each against plain PyTorch (the same model, torch.optim.AdamW,
torch.nn.utils.clip_grad_norm_) on the same GPU in float64 (~1e-10: only summation order
differs). NCCL refuses CPU tensors, so a CPU scalar left in a reduction or a norm fails
here while it passes on gloo.

Needing more than one GPU (two NCCL ranks cannot share a device), and therefore not here:
DDP and ZeRO at dp >= 2 over NCCL (the bucket all-reduce / reduce-scatter, the all-gather
of ZeRO-1/2 parameters and of ZeRO-3 layers, the cross-rank inf flag of the loss scaler,
the all-reduce of the global norm over DP shards), and the same under tp >= 2 / pp >= 2
(the TP all-reduce of sharded norms, pipeline P2P). Their float64 parity runs on gloo in
tests/parallel/data/test_ddp.py and tests/parallel/data/test_zero.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._errors import worst
from tests.gpu._nccl import run_nccl

pytestmark = pytest.mark.gpu

TOL = 1e-10  # float64 parity: only summation order differs
ADAM = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


class _Net(nn.Module):
    """Two GeLU blocks with odd sizes (buckets need padding), 3-D input."""

    def __init__(self, d: int = 7, h: int = 13, f: int = 23, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(h), nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
            for _ in range(2)
        )
        self.head = nn.Linear(h, out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _pair(device: torch.device) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = _Net().double().to(device)
    ref = _Net().double().to(device)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 3, 7, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, 5, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _max_err(mine: dict, ref: nn.Module) -> float:
    return max(
        (mine[n].detach() - p.detach()).abs().max().item() for n, p in ref.named_parameters()
    )


def _ref_step(ref, ropt, x, y, clip: float | None) -> float:
    ropt.zero_grad()
    _loss(ref, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else torch.zeros(())
    ropt.step()
    return float(norm)


def _ddp(dims, device, steps: int = 3) -> dict[str, float]:
    from distllm.parallel import DistributedDataParallel

    model, ref = _pair(device)
    ddp = DistributedDataParallel(model, dims=dims, bucket_cap_mb=0.002)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    ropt = torch.optim.AdamW(ref.parameters(), **ADAM)
    norm_err = 0.0
    for s in range(steps):
        x, y = _batch(s, device)
        ddp.zero_grad()
        _loss(ddp, x, y).backward()
        norm = ddp.clip_grad_norm_(0.05)
        opt.step()
        norm_err = worst(norm_err, abs(float(norm) - _ref_step(ref, ropt, x, y, 0.05)))
    return {"params": _max_err(dict(model.named_parameters()), ref), "norm": norm_err}


def _zero(
    dims, device, stage: int, steps: int = 3, clip: float | None = 0.05, loss_scale=None
) -> dict[str, float]:
    from distllm.parallel import ZeroOptimizer

    model, ref = _pair(device)
    z = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        dims=dims,
        bucket_cap_mb=0.002,
        loss_scale=loss_scale,
        **ADAM,
    )
    ropt = torch.optim.AdamW(ref.parameters(), **ADAM)
    norm_err = 0.0
    for s in range(steps):
        x, y = _batch(s, device)
        z.zero_grad()
        z.scale_loss(_loss(model, x, y)).backward()
        norm = z.clip_grad_norm_(clip) if clip else None
        assert z.step(), "a finite step was skipped"
        rnorm = _ref_step(ref, ropt, x, y, clip)
        if norm is not None:
            norm_err = worst(norm_err, abs(float(norm) - rnorm))
    sd = z.state_dict()
    errs = {"master": _max_err(sd["master"], ref), "norm": norm_err}
    if stage < 3:  # stage 3 keeps only shards of the parameters between steps
        errs["params"] = _max_err(dict(model.named_parameters()), ref)
    return errs


def _dynamic_scale_skips_inf(dims, device) -> dict[str, float]:
    """An inf gradient: the step is skipped, nothing moves, the scale halves."""
    from distllm.parallel import ZeroOptimizer

    model, _ = _pair(device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=2, dims=dims, loss_scale="dynamic", **ADAM)
    scale = z.loss_scale
    x, y = _batch(0, device)
    z.scale_loss(_loss(model, x, y) * float("inf")).backward()
    stepped = z.step()
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    return {
        "stepped": float(stepped),
        "moved": moved,
        "skipped": float(z.skipped_steps),
        "scale_ratio": z.loss_scale / scale,
    }


def _all_cases(device_name: str) -> dict[str, dict[str, float]]:
    from distllm import ParallelDims

    dims = ParallelDims(tp=1, pp=1, dp=1)
    device = torch.device(device_name)
    out = {"ddp+clip": _ddp(dims, device)}
    for stage in (0, 1, 2, 3):
        out[f"zero{stage}+clip"] = _zero(dims, device, stage)
    out["zero2 loss_scale=1024"] = _zero(dims, device, 2, clip=None, loss_scale=1024.0)
    out["zero3 loss_scale=1024+clip"] = _zero(dims, device, 3, loss_scale=1024.0)
    out["dynamic scale, inf grad"] = _dynamic_scale_skips_inf(dims, device)
    return out


def test_ddp_zero_clipping_and_loss_scaling_on_nccl():
    res = run_nccl(_all_cases, "cuda")
    skip = res.pop("dynamic scale, inf grad")
    assert skip == {"stepped": 0.0, "moved": 0.0, "skipped": 1.0, "scale_ratio": 0.5}, skip
    bad = {case: errs for case, errs in res.items() if not worst(errs.values()) < TOL}
    assert not bad, f"differs from plain PyTorch on the same GPU by more than {TOL}: {bad}"
