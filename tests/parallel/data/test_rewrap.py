"""A model wrapped again, and a wrapper dropped (2 gloo ranks, float64): the newest
``DistributedDataParallel`` / ``ZeroOptimizer`` owns the parameters (the first one's gradient
hook set the gradients the second reduced to zero), a dropped wrapper is freed with its
hooks (they held it through torch's hook table, which the collector cannot see), and a model
ZeRO-3 sharded is one error when wrapped again."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from tests._spawn import SpawnCache, case_of, run_cases


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


def _hooks(p: nn.Parameter) -> int:
    return len(p._post_accumulate_grad_hooks or {})


def _ddp(dims, keep_first: bool) -> dict:
    """A rank's batch is its rank + 1 everywhere: the averaged weight gradient is 3.0 on
    2 ranks (sum over 2 rows of 1.5), the bias's 2.0."""
    from distllm.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.full((2, 4), float(dims.rank + 1), dtype=torch.float64)
    first = DistributedDataParallel(model, dims=dims)
    gone = weakref.ref(first)
    if not keep_first:
        del first
        gc.collect()
    ddp = DistributedDataParallel(model, dims=dims)
    ddp(x).sum().backward()
    return {"first_freed": gone() is None, "hooks": _hooks(model.weight),
            "weight": model.weight.grad[0].tolist(), "bias": model.bias.grad.tolist()}


def _zero(dims, stage: int, keep_first: bool) -> dict:
    """SGD (lr 1) on the same batches: the new optimizer's step is the single process's."""
    from distllm.parallel import ZeroOptimizer

    def run(model, opt, x):
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if hasattr(opt, "wait_params"):  # ZeRO-1/2: the updated parameters' gathers
            opt.wait_params()
        return (model[0].weight.detach() - before)[0].tolist()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)).double()
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)).double()
    ref.load_state_dict(model.state_dict())
    x = torch.arange(8 * dims.dp, dtype=torch.float64).view(2 * dims.dp, 4) / 8
    mine = x[2 * dims.dp_rank: 2 * dims.dp_rank + 2]
    first = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, lr=1.0)
    gone = weakref.ref(first)
    if not keep_first:
        del first
        gc.collect()
    out = {"first_freed": gone() is None}
    try:
        z = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, lr=1.0)
    except ValueError as e:
        return {**out, "error": str(e)}
    step = run(model, z, mine)
    want = run(ref, torch.optim.SGD(ref.parameters(), lr=1.0), x)  # mean over the ranks
    want = [w / dims.dp for w in want]  # (the loss is a sum: each rank's is 1/dp of it)
    return {**out, "err": max(abs(a - b) for a, b in zip(step, want, strict=True)),
            "hooks": _hooks(model[0].weight)}


def rewrap_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    cases = {f"ddp-{k}": (lambda k=k: _ddp(dims, k == "kept")) for k in ("kept", "dropped")}
    for stage in (1, 2, 3):
        for k in ("kept", "dropped"):
            cases[f"zero{stage}-{k}"] = lambda s=stage, k=k: _zero(dims, s, k == "kept")
    return run_cases(cases)


@pytest.mark.parametrize("case", ["kept", "dropped"])
def test_a_second_ddp_of_a_model_reduces_its_gradients(spawned, case):
    for r in case_of(spawned(rewrap_main, 2), f"ddp-{case}"):
        assert r["weight"] == [3.0] * 4 and r["bias"] == [2.0] * 3, r
        assert r["hooks"] == 1, r  # the first wrapper's hook is gone, kept or dropped
        assert r["first_freed"] == (case == "dropped"), r


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", ["kept", "dropped"])
def test_a_second_zero_optimizer_steps_as_one_process(spawned, stage, case):
    for r in case_of(spawned(rewrap_main, 2), f"zero{stage}-{case}"):
        assert r["err"] < 1e-12, r
        assert r["hooks"] == 1, r
        assert r["first_freed"] == (case == "dropped"), r


@pytest.mark.parametrize("case", ["kept", "dropped"])
def test_a_model_zero3_sharded_is_one_error_when_wrapped_again(spawned, case):
    for r in case_of(spawned(rewrap_main, 2), f"zero3-{case}"):
        assert r["error"].startswith("ZeroOptimizer(stage=3): the model's parameters were "
                                     "sharded by a ZeroOptimizer(stage=3)"), r
        assert "load a full state dict" in r["error"], r
        assert r["first_freed"] == (case == "dropped"), r
