"""ZeRO-0/1/2/3 against a single process on the global batch (float64, ~1e-10), memory
against the ZeRO paper's model, gradient accumulation, unused parameters, inf/NaN
skipping, checkpoint round trip and overlap of the reduction with backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.testing import run_distributed

TOL = 1e-10  # float64 parity: only summation order differs


class Block(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


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


def groups_of(model: Net, wd: float = 0.1, named: bool = False):
    def pick(dec):
        return [(n, p) if named else p for n, p in model.named_parameters()
                if (n.endswith("weight") and "ln" not in n) == dec]

    decay, rest = pick(True), pick(False)
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def _max_err(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _run_case(dims, stage: int, opt_cls, opt_kw: dict, *, use_groups: bool, clip: float | None,
              prefetch: bool = True, steps: int = 3, rs: str = "auto") -> dict:
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    if stage in (1, 3):  # the module (ZeRO-1: gathers overlap forward); groups by keyword
        z = ZeroOptimizer(model, opt_cls, stage=stage, dims=dims, prefetch=prefetch,
                          param_groups=groups_of(model) if use_groups else None,
                          bucket_cap_mb=0.002, **opt_kw)
    else:
        z = ZeroOptimizer(groups_of(model, named=True) if use_groups else model, opt_cls,
                          stage=stage, dims=dims, bucket_cap_mb=0.002, reduce_scatter_impl=rs,
                          **opt_kw)
    ropt = opt_cls(groups_of(ref) if use_groups else ref.parameters(), **opt_kw)
    norms = []
    for s in range(steps):
        x, y = batch(s)
        z.zero_grad()
        loss_fn(model, local(x, dims), local(y, dims)).backward()
        ropt.zero_grad()
        loss_fn(ref, x, y).backward()
        if clip is not None:
            n1 = z.clip_grad_norm_(clip)
            n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norms.append(abs(n1.item() - n2.item()))
        z.step()
        ropt.step()
    sd = z.state_dict()
    refp = dict(ref.named_parameters())
    errs = {"master": _max_err({k: sd["master"][k] for k in refp}, refp), "norm": max(norms or [0])}
    if stage < 3:
        errs["params"] = _max_err(dict(model.named_parameters()), refp)
    for key in {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}[opt_cls.__name__]:
        mine = {n: sd["state"][n][key] for n in refp}
        theirs = {n: ropt.state[p][key] for n, p in refp.items()}
        errs[key] = _max_err(mine, theirs)
    return errs


def zero_parity(tp: int = 1) -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=tp)
    adam = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    out = {}
    for stage in (0, 1, 2, 3):
        out[f"adamw-s{stage}"] = _run_case(dims, stage, torch.optim.AdamW, adam,
                                           use_groups=stage % 2 == 1, clip=0.05)
    out["adamw-s3-groups"] = _run_case(dims, 3, torch.optim.AdamW, adam, use_groups=True,
                                       clip=0.05, steps=2)
    # SGD with momentum; the reduce-scatter collective itself (auto picks all-reduce on gloo)
    out["sgd-s2-rs"] = _run_case(dims, 2, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                 use_groups=False, clip=0.05, rs="reduce_scatter")
    out["adamw-s3-noprefetch"] = _run_case(dims, 3, torch.optim.AdamW, adam, use_groups=False,
                                           clip=None, prefetch=False, steps=2)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_match_single_process(world):
    res = run_distributed(zero_parity, world, timeout=240)
    for rank_res in res:
        for case, errs in rank_res.items():
            for what, e in errs.items():
                assert e < TOL, f"{case}: {what} differs from the single process by {e:.3g}"


# --- memory, accumulation, unused params, skipping, checkpoints, overlap -----------------------

def _memory(dims) -> dict:
    from distllm.parallel import ZeroOptimizer, memory_report
    from distllm.parallel.data.memory import zero_model_bytes

    out = {}
    for g_bytes, rdt in ((2, torch.bfloat16), (4, torch.float32)):
        for stage in (0, 1, 2, 3):
            model = make(dtype=torch.float32, h=64, f=160, n=2)
            psi = sum(p.numel() for p in model.parameters())
            z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims,
                              param_dtype=torch.bfloat16, reduce_dtype=rdt, bucket_cap_mb=0.05)
            x, y = batch(0)
            loss_fn(model, local(x, dims).bfloat16(), local(y, dims).bfloat16()).backward()
            z.step()
            rep = memory_report(z)
            want = zero_model_bytes(psi, dims.dp, stage, grad_bytes=g_bytes)
            slack = len(z.reducer.buckets) * (dims.dp * 16 + 8)  # padding + Adam's step scalars
            out[(stage, g_bytes)] = (rep.total, want, slack)
    return out


def _accumulation(dims) -> dict:
    """Two micro-batches (first under no_sync) equal one big batch; unused parameters."""
    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage in (1, 2, 3):
        model, ref = make(unused=True), make(unused=True)
        z = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, lr=0.1,
                          bucket_cap_mb=0.002)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x, y = batch(0)
        xl, yl = local(x, dims), local(y, dims)
        h = xl.shape[0] // 2
        with z.no_sync():
            (0.5 * loss_fn(model, xl[:h], yl[:h])).backward()
        (0.5 * loss_fn(model, xl[h:], yl[h:], use_extra=dims.dp_rank == 0)).backward()
        z.step()
        # the reference: rank 0's second half also goes through `extra` (scaled to the mean)
        n = x.shape[0] // dims.dp
        ref_loss = loss_fn(ref, x, y)
        ye = ref(x[n // 2: n], use_extra=True) - ref(x[n // 2: n])
        extra = (ref(x[n // 2: n]) + ye - y[n // 2: n]).pow(2).mean() - loss_fn(
            ref, x[n // 2: n], y[n // 2: n])
        (ref_loss + extra * 0.5 / dims.dp).backward()
        ropt.step()
        sd = z.state_dict()
        out[stage] = max((sd["master"][k] - p).abs().max().item()
                         for k, p in ref.named_parameters())
    return out


def _skip_and_reload(dims) -> dict:
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=2, dims=dims, lr=1e-2, bucket_cap_mb=0.002)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = batch(0)
    loss_fn(model, local(x, dims), local(y, dims)).backward()
    z.step()
    loss_fn(ref, x, y).backward()
    ropt.step()
    # a NaN on one rank only: every rank skips
    z.zero_grad()
    scale = float("nan") if dims.dp_rank == dims.dp - 1 else 1.0
    (scale * loss_fn(model, local(x, dims), local(y, dims))).backward()
    stepped = z.step()
    # checkpoint into a stage-1 and a stage-3 optimizer, then one more step each
    sd = z.state_dict()
    errs = {}
    ropt.zero_grad()
    x2, y2 = batch(1)
    loss_fn(ref, x2, y2).backward()
    ropt.step()
    for stage in (1, 3):
        m2 = make(seed=5)
        z2 = ZeroOptimizer(m2, torch.optim.AdamW, stage=stage, dims=dims, lr=1e-2,
                           bucket_cap_mb=0.001)
        z2.load_state_dict(sd)
        loss_fn(m2, local(x2, dims), local(y2, dims)).backward()
        z2.step()
        sd2 = z2.state_dict()
        errs[stage] = max((sd2["master"][k] - p).abs().max().item()
                          for k, p in ref.named_parameters())
    return {"stepped": stepped, "skipped": z.skipped_steps, "reload": errs}


def _loss_scale(dims) -> dict:
    """Dynamic loss scaling: a scaled loss gives the unscaled update; an overflow halves the
    scale and skips the step."""
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=1, dims=dims, lr=1e-2,
                      loss_scale="dynamic")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = batch(0)
    s0 = z.loss_scale
    z.scale_loss(loss_fn(model, local(x, dims), local(y, dims))).backward()
    z.clip_grad_norm_(0.05)
    z.step()
    loss_fn(ref, x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ropt.step()
    z.wait_params()  # the parameter all-gather overlaps the next forward; read after waiting
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(),
                                                         strict=True))
    z.zero_grad()
    z.scale_loss(float("inf") * loss_fn(model, local(x, dims), local(y, dims))).backward()
    stepped = z.step()
    return {"err": err, "halved": z.loss_scale == s0 / 2, "stepped": stepped,
            "skipped": z.skipped_steps}


def _overlap(dims) -> dict:
    """Record when each bucket's reduction starts against backward's progress."""
    import time

    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage in (1, 2, 3):
        model = make(h=64, f=256, n=4)
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims, bucket_cap_mb=0.05)
        last = {}
        def mark_end(_p, last=last) -> None:  # inp.weight's gradient is the last to land
            last["t"] = time.perf_counter()

        model.inp.weight.register_post_accumulate_grad_hook(mark_end)
        z.reducer.start_cycle_log()
        x, y = batch(0)
        loss_fn(model, local(x, dims), local(y, dims)).backward()
        log = z.reducer.launch_log
        nparams = len(list(model.parameters()))
        out[stage] = {"buckets": len(z.reducer.buckets), "first_hooks": log[0][2],
                      "nparams": nparams, "before_end": sum(t < last["t"] for _, t, _ in log),
                      "in_backward": z.reducer.launches_in_backward}
        z.step()
    return out


def zero_extras() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return {"memory": _memory(dims), "accum": _accumulation(dims),
            "skip": _skip_and_reload(dims), "overlap": _overlap(dims),
            "scale": _loss_scale(dims)}


def test_zero_memory_accumulation_skip_reload_overlap():
    res = run_distributed(zero_extras, 2, timeout=240)
    for r in res:
        for (stage, g), (got, want, slack) in r["memory"].items():
            assert abs(got - want) <= slack, (
                f"stage {stage}, {g}-byte grads: {got} bytes held, ZeRO model says {want:.0f}")
        for stage, e in r["accum"].items():
            assert e < TOL, f"stage {stage}: no_sync accumulation + unused params off by {e:.3g}"
        assert r["skip"]["stepped"] is False and r["skip"]["skipped"] == 1
        for stage, e in r["skip"]["reload"].items():
            assert e < TOL, f"reload into stage {stage}: off by {e:.3g}"
        sc = r["scale"]
        assert sc["err"] < TOL and sc["halved"] and not sc["stepped"] and sc["skipped"] == 1, sc
        for stage, o in r["overlap"].items():
            assert o["buckets"] > 2, o
            assert o["first_hooks"] < o["nparams"], f"stage {stage}: launched after backward {o}"
            assert o["before_end"] >= 1 and o["in_backward"] >= 2, f"stage {stage}: {o}"


def test_bad_input():
    from distllm.parallel import ZeroOptimizer

    m = make()
    with pytest.raises(ValueError, match="stage=4"):
        ZeroOptimizer(m, torch.optim.AdamW, stage=4, dims=None)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        ZeroOptimizer(m, object, stage=1, dims=None)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        ZeroOptimizer(m, torch.optim.AdamW(m.parameters()), stage=1, dims=None)
    with pytest.raises(ValueError, match="no parameters"):
        ZeroOptimizer(nn.GELU(), torch.optim.AdamW, stage=1, dims=None)
    with pytest.raises(ValueError, match="stage=3 needs the nn.Module"):
        ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=3, dims=None)
    with pytest.raises(ValueError, match="dims=None"):
        ZeroOptimizer(m, torch.optim.AdamW, stage=1, dims=None)
    with pytest.raises(ValueError, match="has no dp_group"):
        ZeroOptimizer(m, torch.optim.AdamW, stage=1, dims=object())
    assert not dist.is_initialized()
