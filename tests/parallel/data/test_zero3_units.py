"""ZeRO-3 units against a float64 single process (2 gloo ranks, ~1e-10): gradient
accumulation where a unit's parameter gets no gradient in some micro-batches (its landed
count restarts with each backward pass), on some ranks only (the collectives must still
pair up), a unit whose backward is entered twice per pass,
units recomputed by reentrant activation checkpointing, and a weight tied between two
layers (GPT's ``tie_embeddings``), which belongs to the root unit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._errors import worst
from tests._spawn import SpawnCache, case_of, run_cases
from tests.parallel.data._common import OPT, TOL, adamw, groups_of, local, max_err, set_lr


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


class _Gated(nn.Module):
    """A residual MLP whose output is scaled by ``gate`` only when asked: ``gate`` gets no
    gradient in a micro-batch that does not use it."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 2 * h + 1)
        self.down = nn.Linear(2 * h + 1, h)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, h))

    def forward(self, x, use_gate: bool):  # (..., h) -> (..., h)
        y = self.down(torch.tanh(self.up(x)))
        return x + (self.gate * y if use_gate else y)


class _GatedNet(nn.Module):
    """``how``: "plain" (each block once), "twice" (each block twice, its gate only in the
    second call), "reentrant" or "nonreentrant" (each block under activation checkpointing
    of that kind)."""

    def __init__(self, how: str, d_in: int = 7, h: int = 13, n: int = 3, out: int = 5) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(d_in, h)
        self.blocks = nn.ModuleList(_Gated(h) for _ in range(n))
        self.head = nn.Linear(h, out)

    def forward(self, x, use_gate: bool):
        x = self.inp(x)
        for b in self.blocks:
            if self.how == "twice":
                x = b(b(x, False), use_gate)
            elif self.how in ("reentrant", "nonreentrant"):
                x = checkpoint(b, x, use_gate, use_reentrant=self.how == "reentrant")
            else:
                x = b(x, use_gate)
        return self.head(x)


def _gated_net(how: str, h: int = 13) -> _GatedNet:
    torch.manual_seed(0)
    return _GatedNet(how, h=h).double()


# each step's micro-batches: whether each uses the gates (the last one is synchronised)
GATES = ((False, True, False), (True, False, True), (False, False, True))
LOSS_SCALE = 4.0  # gradient norms of 2.7 to 3.3: clipping acts on every step


def _accumulate(dims, how: str, stage: int = 3, prefetch: bool = True,
                per_rank: bool = False) -> dict:
    """Three steps of three micro-batches (the first two under ``no_sync``), gates used in
    some of them, clipped AdamW (clipping on every step: ``ref_norms``); the reference runs
    each micro-batch on the global rows. ``per_rank``: DP rank 0 uses the gates where GATES
    says, the other ranks where it does not, in units whose shards (64 KiB or more) the
    gathers and reduce-scatters send point to point."""
    from distllm.parallel import ZeroOptimizer

    h = 64 if per_rank else 13
    model, ref = _gated_net(how, h), _gated_net(how, h)
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims, prefetch=prefetch,
                      param_groups=groups_of(model), bucket_cap_mb=0.002, **adamw())
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    g = torch.Generator().manual_seed(3)
    held, norms, ref_norms = [], [], []
    for step, gates in enumerate(GATES):
        set_lr(step, z, ropt)
        z.zero_grad()
        ropt.zero_grad()
        for k, use in enumerate(gates):
            x = torch.randn(4 * dims.dp, 3, 7, generator=g, dtype=torch.float64)
            last = k == len(gates) - 1
            uses = [use == (r == 0) if per_rank else use for r in range(dims.dp)]
            with z.no_sync() if not last else contextlib.nullcontext():
                (model(local(x, dims), uses[dims.dp_rank]).square().mean() * LOSS_SCALE
                 / len(gates)).backward()
            if stage == 3 and not last:
                held.append(z.sharded.full_bytes_held())
            n = x.shape[0] // dims.dp
            (sum(ref(x[r * n:(r + 1) * n], u).square().mean() for r, u in enumerate(uses))
             * LOSS_SCALE / dims.dp / len(gates)).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip).item())
        norms.append(abs(z.clip_grad_norm_(OPT.grad_clip).item() - ref_norms[-1]))
        z.step()
        ropt.step()
        if stage == 3:
            held.append(z.sharded.full_bytes_held())
    order = [z.sharded.units.index(u) for u in z.sharded._order] if stage == 3 else []
    return {"master": max_err(z.state_dict()["master"], dict(ref.named_parameters())),
            "norm": max(norms), "ref_norms": ref_norms, "held": held, "order": order}


def _forward_before_step(dims) -> dict:
    """A forward with grad on between backward and ``step`` (its result unused) leaves the
    root and the last unit gathered: the step must not leave their old values in use."""
    from distllm.parallel import ZeroOptimizer

    model, ref = _gated_net("plain"), _gated_net("plain")
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims,
                      param_groups=groups_of(model), **adamw())
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    g = torch.Generator().manual_seed(4)
    out = 0.0
    for step in range(2):
        set_lr(step, z, ropt)
        x = torch.randn(4 * dims.dp, 3, 7, generator=g, dtype=torch.float64)
        model(local(x, dims), True).square().mean().backward()
        ref(x, True).square().mean().backward()
        model(local(x, dims), True)  # e.g. a metric computed without no_grad
        z.step()
        ropt.step()
        z.zero_grad()
        ropt.zero_grad()
        with torch.no_grad():
            out = worst(out, (model(local(x, dims), True) - ref(local(x, dims), True)).abs()
                      .max().item())
    full = z.full_state_dict()
    return {"master": max_err(z.state_dict()["master"], dict(ref.named_parameters())),
            "forward": out,
            "full": max_err(full, dict(ref.named_parameters()))}


def gated_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    cases = {f"{how}-s3": (lambda how=how: _accumulate(dims, how))
             for how in ("plain", "twice", "reentrant", "nonreentrant")}
    cases["plain-s3-no-prefetch"] = lambda: _accumulate(dims, "plain", prefetch=False)
    cases["twice-s3-no-prefetch"] = lambda: _accumulate(dims, "twice", prefetch=False)
    for stage in (1, 2):
        cases[f"plain-s{stage}"] = lambda stage=stage: _accumulate(dims, "plain", stage)
    for how in ("plain", "twice", "nonreentrant"):
        cases[f"{how}-s3-per-rank"] = lambda how=how: _accumulate(dims, how, per_rank=True)
    cases["plain-s3-per-rank-no-prefetch"] = lambda: _accumulate(dims, "plain", prefetch=False,
                                                                 per_rank=True)
    cases["forward-before-step"] = lambda: _forward_before_step(dims)
    return run_cases(cases)


CASES = ["plain-s1", "plain-s2", "plain-s3", "plain-s3-no-prefetch", "twice-s3",
         "twice-s3-no-prefetch", "reentrant-s3", "nonreentrant-s3", "plain-s3-per-rank",
         "twice-s3-per-rank", "nonreentrant-s3-per-rank", "plain-s3-per-rank-no-prefetch"]


@pytest.mark.parametrize("case", CASES)
def test_accumulation_with_parameters_unused_in_some_micro_batches(spawned, case):
    for r in case_of(spawned(gated_main, 2), case):
        assert r["master"] < TOL and r["norm"] < TOL, f"{case}: {r}"
        assert min(r["ref_norms"]) > OPT.grad_clip, r["ref_norms"]  # clipping at work
        if "-s3" in case:
            # a unit is freed once its backward is done, whether or not each of its
            # parameters got a gradient in that pass: after each micro-batch, nothing is held
            assert r["held"] == [0] * 9, r["held"]


def test_a_forward_between_backward_and_step_sees_the_new_weights(spawned):
    for r in case_of(spawned(gated_main, 2), "forward-before-step"):
        assert r["master"] < TOL and r["forward"] < TOL and r["full"] < TOL, r


@pytest.mark.parametrize("how", ["reentrant", "nonreentrant"])
def test_a_recomputed_unit_is_gathered_as_a_forward_one(spawned, how):
    """Activation checkpointing recomputes each block inside backward; its forward hook
    took that for a new forward: it prefetched the block after it (whose backward was
    done), which stayed gathered, and recorded the forward order backwards (the next step
    prefetched the wrong way). What stays gathered after each micro-batch and the order are
    the plain model's."""
    res = spawned(gated_main, 2)
    for r, plain in zip(case_of(res, f"{how}-s3"), case_of(res, "plain-s3"), strict=True):
        assert r["order"] == plain["order"] == sorted(plain["order"]), (r, plain)
        assert r["held"] == plain["held"], (r["held"], plain["held"])


# --- a weight tied between two layers ----------------------------------------------------------

def _gpt(dims):
    from distllm.models.config import GPTConfig
    from distllm.models.gpt import GPT

    cfg = GPTConfig.preset("tiny", tie_embeddings=True, n_layers=2, hidden_size=32, n_heads=2,
                           ffn_hidden_size=64, vocab_size=61, max_seq_len=16)
    return GPT(cfg, dims, dtype=torch.float64, seed=0, overlap="none")


def _tied(dims, head_is_unit: bool) -> dict:
    """The tied GPT at ZeRO-3 with the engine's units (every layer), or without the head
    among them (its weights are the root's leftovers, the tied one held by the embedding
    unit too): three clipped AdamW steps of two micro-batches (the first under ``no_sync``,
    as the engine runs them), then its state dicts."""
    from distllm.parallel import ZeroOptimizer

    model, ref = _gpt(dims), _gpt(dims)
    layers = model.layer_list()
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims,
                      param_groups=groups_of(model), units=layers if head_is_unit
                      else layers[:-1], **adamw())
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    wte = model.layers["0"].wte.weight
    out = {"tied": wte is layers[-1].lm_head.weight, "root": z.sharded.unit_of[wte] is model}
    g = torch.Generator().manual_seed(1)
    norms = []
    for step in range(3):
        set_lr(step, z, ropt)
        x = torch.randint(0, 61, (2 * dims.dp, 16), generator=g)
        z.zero_grad()
        ropt.zero_grad()
        xl = local(x, dims)
        with z.no_sync():
            (model.loss(model(xl[:1]), xl[:1]) / 2).backward()
        (model.loss(model(xl[1:]), xl[1:]) / 2).backward()
        ref.loss(ref(x), x).backward()
        norms.append(abs(z.clip_grad_norm_(OPT.grad_clip).item()
                         - torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip).item()))
        z.step()
        ropt.step()
    out.update(norm=worst(norms), weights=max_err(model.state_dict(), ref.state_dict()),
               master=max_err(z.state_dict()["master"], dict(ref.named_parameters())),
               held=z.sharded.full_bytes_held())
    # the model's state dict loads into another tied ZeRO-3 model, whose forward agrees
    m2 = _gpt(dims)
    ZeroOptimizer(m2, torch.optim.AdamW, stage=3, dims=dims, units=m2.layer_list(), **adamw())
    m2.load_state_dict(model.state_dict())
    with torch.no_grad():
        out["reload"] = (m2(x) - ref(x))[..., :61].abs().max().item()  # (the padding: -inf)
    return out


def tied_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return run_cases({"head-unit": lambda: _tied(dims, True),
                      "head-leftover": lambda: _tied(dims, False)})


@pytest.mark.parametrize("case", ["head-unit", "head-leftover"])
def test_zero3_tied_embedding_matches_single_process(spawned, case):
    for r in case_of(spawned(tied_main, 2), case):
        assert r["tied"] and r["root"], r  # the shared weight is the root unit's
        for what in ("norm", "weights", "master", "reload"):
            assert r[what] < TOL, f"{case}: {what} differs from the single process: {r}"
        assert r["held"] == 0, r


# --- a unit of mixed dtypes ---------------------------------------------------------------------

def _mixed_init(dims, stage: int) -> dict:
    """A unit holding a bf16 Linear and an fp32 LayerNorm, ``param_dtype=bf16``: the fp32
    masters start from the parameters' own values (the LayerNorm's are not bf16 numbers)."""
    from distllm.parallel import ZeroOptimizer

    blk = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8))
    with torch.no_grad():
        blk[1].weight.copy_(1 + 1e-3 * torch.arange(8, dtype=torch.float32))
    orig = blk[1].weight.detach().clone()
    z = ZeroOptimizer(nn.ModuleList([blk]), torch.optim.AdamW, stage=stage, dims=dims,
                      param_dtype=torch.bfloat16, lr=0.0)
    m = z.state_dict()["master"]["0.1.weight"]
    return {"dtype": str(m.dtype), "err": (m - orig).abs().max().item()}


def mixed_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return run_cases({f"s{s}": (lambda s=s: _mixed_init(dims, s)) for s in (1, 3)})


@pytest.mark.parametrize("case", ["s1", "s3"])
def test_masters_start_from_the_parameters_in_a_mixed_dtype_unit(spawned, case):
    for r in case_of(spawned(mixed_main, 2), case):
        assert r == {"dtype": "torch.float32", "err": 0.0}, r
