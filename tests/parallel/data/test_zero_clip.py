"""ZeRO clipping without ``zero_grad`` between steps: stages 0-3 on 2 gloo ranks against a
float64 single process. At stages 0-1 the gradients carry over (the next backward adds to the
clipped gradient, as with torch and DDP), with the replicated buckets clipped whole (the
``.grad`` views read the clipped gradient, every rank's bucket the same); at stages 2-3 the
step consumes its gradient shards (no ``.grad`` holds them), as the reference's cleared
gradients do."""

from __future__ import annotations

import pytest
import torch

from tests._errors import worst
from tests._spawn import SpawnCache, case_of, run_cases
from tests.parallel.data._common import TOL, batch, local, loss_fn, make

MAX_NORM = 0.05  # below every step's norm: clipping engages each time (checked)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


def _carry_over(dims, stage: int, loss_scale: float | None = None,
                one_reduce: bool = False) -> dict:
    """Three steps of SGD with momentum, clipped, never zeroing the gradients. ``loss_scale``
    (a power of two: exact in float64) makes the masters' gradients copies of the buckets;
    ``one_reduce``: clip with ``clip_and_check`` (the trainer's call) instead."""
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    kw = dict(lr=0.1, momentum=0.9)
    z = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, bucket_cap_mb=0.002,
                      loss_scale=loss_scale, **kw)
    ropt = torch.optim.SGD(ref.parameters(), **kw)
    scale = loss_scale or 1.0
    norms, ref_norms, grads = [], [], []
    for s in range(3):
        x, y = batch(s)
        z.scale_loss(loss_fn(model, local(x, dims), local(y, dims))).backward()
        loss_fn(ref, x, y).backward()
        n = z.clip_and_check(MAX_NORM)[0] if one_reduce else z.clip_grad_norm_(MAX_NORM)
        norms.append(n.item())
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        if stage <= 1:  # the .grad views of the replicated buckets, clipped
            grads.append(worst((p.grad / scale - q.grad).abs().max().item()
                             for p, q in zip(model.parameters(), ref.parameters(), strict=True)))
        z.step()
        ropt.step()
        if stage >= 2:
            ref.zero_grad()
    sd = z.state_dict()["master"]
    return {"master": worst((sd[k] - p).abs().max().item() for k, p in ref.named_parameters()),
            "norm": worst(abs(a - b) for a, b in zip(norms, ref_norms, strict=True)),
            "grads": max(grads, default=0.0), "ref_norms": ref_norms}


CASES = {f"s{s}": dict(stage=s) for s in range(4)}
CASES.update({"s0-loss-scale": dict(stage=0, loss_scale=1024.0),
              "s1-loss-scale": dict(stage=1, loss_scale=1024.0),
              "s1-clip-and-check": dict(stage=1, one_reduce=True)})


def clip_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return run_cases({name: (lambda kw=kw: _carry_over(dims, **kw)) for name, kw in CASES.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_clipped_gradients_carry_over_without_zero_grad(spawned, case):
    for r in case_of(spawned(clip_main, 2), case):
        assert min(r["ref_norms"]) > MAX_NORM, r  # clipping engaged at every step
        for what in ("master", "norm", "grads"):
            assert r[what] < TOL, f"{case}: {what} differs from the single process: {r}"
