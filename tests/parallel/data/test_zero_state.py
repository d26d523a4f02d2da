"""The model's own ``state_dict()`` / ``load_state_dict()`` under ZeroOptimizer: full tensors
at stage 3 (gathered over DP, never the empty shards), loads that reach the shards and the
mixed-precision master weights, on 2 gloo ranks against a float64 single process; and the
loss scaler's state in the optimizer's own ``state_dict()``."""

from __future__ import annotations

import io

import pytest
import torch

from tests._spawn import SpawnCache
from tests.parallel.data._common import (
    OPT,
    TOL,
    adamw,
    batch,
    groups_of,
    local,
    loss_fn,
    make,
    max_err,
    train_step,
)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


def _zero3(model, dims):
    from distllm.parallel import ZeroOptimizer

    return ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims,
                         param_groups=groups_of(model), bucket_cap_mb=0.002, **adamw())


def _after_one_step(dims) -> dict:
    model, ref = make(), make()
    z = _zero3(model, dims)
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    train_step(z, ropt, model, ref, dims, 0)
    sd, want = model.state_dict(), ref.state_dict()
    out = {"shapes": {k: (tuple(v.shape), tuple(want[k].shape)) for k, v in sd.items()},
           "module": max_err(sd, want), "full_state_dict": max_err(z.full_state_dict(), want),
           "held_after": z.sharded.full_bytes_held(),
           "sharded_after": all(p.numel() == 0 for p in model.parameters())}
    for sub in ("blocks.1", "head"):  # a gather unit; leftovers of the root unit
        out[sub] = max_err(model.get_submodule(sub).state_dict(),
                           ref.get_submodule(sub).state_dict())
    # loaded values reach the shards (the next step starts from them) and the optimizer goes
    # on: load other weights into both, then one more step each
    other = make(seed=5).state_dict()
    model.load_state_dict(other)
    ref.load_state_dict(other)
    out["loaded"] = max_err(model.state_dict(), other)
    train_step(z, ropt, model, ref, dims, 1)
    out["step_after_load"] = max_err(model.state_dict(), ref.state_dict())
    out["master_after_load"] = max_err(z.state_dict()["master"], dict(ref.named_parameters()))
    return out


def _round_trip(dims) -> dict:
    """torch.save of the full state dict, loaded into a fresh ZeRO-3 model of other weights."""
    model, ref = make(), make()
    z = _zero3(model, dims)
    train_step(z, torch.optim.AdamW(groups_of(ref), **adamw()), model, ref, dims, 0)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    m2 = make(seed=5)
    z2 = _zero3(m2, dims)
    buf.seek(0)
    m2.load_state_dict(torch.load(buf, weights_only=True))
    x, _ = batch(1)
    with torch.no_grad():
        fwd = (m2(local(x, dims)) - ref(local(x, dims))).abs().max().item()
    return {"state_dict": max_err(m2.state_dict(), ref.state_dict()), "forward": fwd,
            "held_after": z2.sharded.full_bytes_held()}


def _load_while_gathered(dims) -> dict:
    """A forward with grad and no backward keeps the root unit and the last layer gathered:
    a load then writes into their full views, and must reach the shards (the masters) too;
    then one more step against the same load and step on one process."""
    model, ref = make(), make()
    z = _zero3(model, dims)
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    x, y = batch(0)
    loss_fn(model, local(x, dims), local(y, dims))  # (a validation loss without no_grad)
    other = make(seed=5).state_dict()
    model.load_state_dict(other)
    ref.load_state_dict(other)
    z.sharded.end_step()  # what step() does first: the gathered units are freed
    out = {"full": max_err(z.full_state_dict(), other),
           "master": max_err(z.state_dict()["master"], other)}
    train_step(z, ropt, model, ref, dims, 1)
    out["step"] = max_err(model.state_dict(), ref.state_dict())
    return out


def _mixed_masters(dims) -> dict:
    """bf16 parameters, fp32 masters: a loaded fp32 state dict reaches the masters exactly."""
    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage in (0, 1, 2, 3):
        model = make(dtype=torch.float32)
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims,
                          param_dtype=torch.bfloat16, bucket_cap_mb=0.002, **adamw())
        x, y = batch(0)
        loss_fn(model, local(x, dims).bfloat16(), local(y, dims).bfloat16()).backward()
        z.step()
        other = make(seed=5, dtype=torch.float32).state_dict()
        model.load_state_dict(other)
        out[stage] = {"master": max_err(z.state_dict()["master"], other),
                      "params": max_err(model.state_dict(),
                                        {k: v.bfloat16() for k, v in other.items()})}
    return out


def _assign_refused(dims) -> str:
    model = make()
    _zero3(model, dims)
    try:
        model.load_state_dict(make(seed=5).state_dict(), assign=True)
    except ValueError as e:
        return str(e)
    return "no error"


def _scaler_state(dims) -> dict:
    """ZeroOptimizer.state_dict() carries the dynamic loss scaler's state (its count of good
    steps too); loading it leaves an optimizer without loss scaling, or with a constant
    one, as it was (its gradient norm stays the single process's)."""
    from distllm.parallel import ZeroOptimizer

    def build(loss_scale):
        model = make()
        return model, ZeroOptimizer(model, torch.optim.AdamW, stage=1, dims=dims,
                                    loss_scale=loss_scale, **adamw())

    model, z = build("dynamic")
    for s in range(2):
        x, y = batch(s)
        z.zero_grad()
        z.scale_loss(loss_fn(model, local(x, dims), local(y, dims))).backward()
        z.step()
    sd = z.state_dict()
    out = {"saved": sd["loss_scaler"], "dynamic": build("dynamic")[1], "constant": build(8.0)[1]}
    for key in ("dynamic", "constant"):
        out[key].load_state_dict(sd)
        out[key] = out[key].scaler.state_dict()
    old = {k: v for k, v in sd.items() if k != "loss_scaler"}  # saved before it was kept
    z_old = build("dynamic")[1]
    z_old.load_state_dict({**old, "loss_scale": 1024.0})
    out["old"] = z_old.scaler.state_dict()
    m_none, z_none = build(None)
    z_none.load_state_dict(sd)
    ref = make()
    ref.load_state_dict(m_none.state_dict())
    x, y = batch(2)
    loss_fn(m_none, local(x, dims), local(y, dims)).backward()
    loss_fn(ref, x, y).backward()
    out["none_scale"] = z_none.loss_scale
    out["none_norm"] = abs(z_none.clip_grad_norm_(float("inf")).item()
                           - torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item())
    return out


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.s


class _Scalars(torch.nn.Module):
    """Net with learnable scalars (0-dim parameters): a module's after it, which leads the
    first bucket (the buckets follow the modules backwards), and one on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.nn.Parameter(torch.tensor(0.25))
        self.net = make()
        self.scale = _Scale()

    def forward(self, x):
        return self.scale(self.net(x)) + self.shift


def _optimizer_round_trips(dims) -> dict:
    """Per stage, against torch's AdamW in float64 with the trainer's settings: the
    optimizer's own state_dict loaded back between two steps, with 0-dim parameters (their
    moments are 0-dim, like a step count: the load broadcast them over the shard and the
    next step crashed); then a state saved before the first step loaded into the optimizer
    that has stepped (its moments and step counts were kept), and one more step."""
    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        model, ref = _Scalars().double(), _Scalars().double()
        ref.load_state_dict(model.state_dict())
        # one group (the trainer's weight decay on every parameter): a scalar leads a bucket
        kw = adamw(weight_decay=OPT.weight_decay)
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims, **kw)
        assert any(len(b.shapes[0]) == 0 for b in z.reducer.buckets), stage
        ropt = torch.optim.AdamW(ref.parameters(), **kw)
        fresh = {"sd": z.state_dict(), "model": {k: v.clone()
                                                 for k, v in ref.state_dict().items()}}
        train_step(z, ropt, model, ref, dims, 0)
        z.load_state_dict(z.state_dict())
        train_step(z, ropt, model, ref, dims, 1)
        between = max_err(model.state_dict(), ref.state_dict())
        z.load_state_dict(fresh["sd"])
        ref.load_state_dict(fresh["model"])
        ropt = torch.optim.AdamW(ref.parameters(), **kw)
        train_step(z, ropt, model, ref, dims, 2)
        out[stage] = {"between": between,
                      "from_before": max_err(model.state_dict(), ref.state_dict())}
    return out


def zero_module_state() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return {"step": _after_one_step(dims), "round_trip": _round_trip(dims),
            "gathered": _load_while_gathered(dims),
            "mixed": _mixed_masters(dims), "assign": _assign_refused(dims),
            "scaler": _scaler_state(dims), "optimizer": _optimizer_round_trips(dims)}


def _results(spawned) -> list[dict]:
    return spawned(zero_module_state, 2)


def test_zero3_state_dict_holds_full_tensors(spawned):
    for r in _results(spawned):
        for k, (got, want) in r["step"]["shapes"].items():
            assert got == want, f"{k}: state_dict gives shape {got}, the model's is {want}"
        assert r["step"]["module"] < TOL, r["step"]


def test_zero3_full_state_dict(spawned):
    for r in _results(spawned):
        assert r["step"]["full_state_dict"] < TOL, r["step"]


@pytest.mark.parametrize("sub", ["blocks.1", "head"])
def test_zero3_submodule_state_dict(spawned, sub):
    for r in _results(spawned):
        assert r["step"][sub] < TOL, f"{sub}.state_dict() off by {r['step'][sub]:.3g}"


def test_zero3_state_dict_reshards(spawned):
    for r in _results(spawned):
        assert r["step"]["held_after"] == 0 and r["step"]["sharded_after"], r["step"]
        assert r["round_trip"]["held_after"] == 0, r["round_trip"]


def test_zero3_load_state_dict_then_train(spawned):
    for r in _results(spawned):
        s = r["step"]
        assert s["loaded"] == 0.0, s
        assert s["step_after_load"] < TOL and s["master_after_load"] < TOL, s


def test_zero3_load_into_units_a_forward_keeps_gathered(spawned):
    for r in _results(spawned):
        g = r["gathered"]
        assert g["full"] == 0.0 and g["master"] == 0.0 and g["step"] < TOL, g


def test_zero3_save_load_round_trip(spawned):
    for r in _results(spawned):
        rt = r["round_trip"]
        assert rt["state_dict"] < TOL and rt["forward"] < TOL, rt


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_state_dict_reaches_mixed_precision_masters(spawned, stage):
    for r in _results(spawned):
        m = r["mixed"][stage]
        assert m["master"] == 0.0 and m["params"] == 0.0, f"stage {stage}: {m}"


def test_load_state_dict_with_assign_is_refused(spawned):
    for r in _results(spawned):
        assert "assign=False" in r["assign"], r["assign"]


def test_optimizer_state_dict_carries_the_loss_scaler(spawned):
    from distllm.parallel.data.loss_scale import DYNAMIC_INIT

    for r in _results(spawned):
        sc = r["scaler"]
        assert sc["saved"] == {"dynamic": True, "scale": DYNAMIC_INIT, "good_steps": 2}, sc
        assert sc["dynamic"] == sc["saved"], sc  # a resumed run grows the scale on time
        assert sc["constant"]["scale"] == 8.0, sc  # a constant scale is a setting, kept
        assert sc["old"] == {"dynamic": True, "scale": 1024.0, "good_steps": 0}, sc
        # no loss scaling: its gradients are not divided by the loaded scale
        assert sc["none_norm"] < TOL, f"gradient norm off by {sc['none_norm']:.3g}"
        assert sc["none_scale"] == 1.0, sc


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_state_dict_round_trips_with_scalars_and_before_any_step(spawned, stage):
    for r in _results(spawned):
        o = r["optimizer"][stage]
        assert o["between"] < TOL and o["from_before"] < TOL, f"stage {stage}: {o}"
