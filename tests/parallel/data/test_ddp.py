"""distllm DDP against torch's DDP and a single process on the global batch (float64,
~1e-10); gradient accumulation, clipping (also across TP), unused parameters, overlap of
the all-reduce with backward, dp == 1, and bad input. One spawn per rank function and
world size; each scenario is its own test."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._errors import worst
from tests._spawn import SpawnCache
from tests.parallel.data._common import TOL, batch, local, loss_fn, make


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


def _max_diff(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    if grads:
        return worst((p.grad - q.grad).abs().max().item() for p, q in pairs)
    return worst((p - q).abs().max().item() for p, q in pairs)


def _parity(dims, overlap: bool = True) -> dict:
    """AdamW steps: distllm DDP vs torch DDP vs one process, with each way of zeroing: DDP's
    ``zero_grad()`` (to None), the optimizer's, DDP's ``zero_grad(set_to_none=False)`` (views
    kept, zeroed), and none (the last step adds to the clipped gradients of the one before).
    Steps 1 and 2 accumulate two micro-batches (the first under no_sync); clipping at every
    step. ``overlap``: ``overlap_grad_reduce`` (False: every bucket after backward)."""
    from distllm.parallel import DistributedDataParallel

    mine, theirs, ref = make(), make(), make()
    d = DistributedDataParallel(mine, dims=dims, bucket_cap_mb=0.002, first_bucket_mb=0.0005,
                                overlap_grad_reduce=overlap)
    t = nn.parallel.DistributedDataParallel(theirs, process_group=dims.dp_group,
                                            bucket_cap_mb=0.002)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
            for m in (mine, theirs, ref)]
    errs = {"grad_vs_torch": 0.0, "norm": 0.0, "views": True, "zeroed_to_none": True,
            "zeroed_in_place": True}

    def views() -> bool:
        return all(p.grad is not None and d.reducer.view(p).data_ptr() == p.grad.data_ptr()
                   for p in mine.parameters())

    for s in range(7):
        x, y = batch(s)
        xl, yl = local(x, dims), local(y, dims)
        if s % 3 == 0 and s < 6:
            d.zero_grad()
            errs["zeroed_to_none"] &= all(p.grad is None for p in mine.parameters())
        elif s % 3 == 1:
            opts[0].zero_grad()  # torch's set_to_none, behind DDP's back
        elif s % 3 == 2:
            d.zero_grad(set_to_none=False)
            errs["zeroed_in_place"] &= views() and not any(p.grad.any()
                                                           for p in mine.parameters())
        if s < 6:
            for o in opts[1:]:
                o.zero_grad()
        if s in (1, 2):  # gradient accumulation: 2 micro-batches
            h = xl.shape[0] // 2
            for model in (d, t):
                with model.no_sync():
                    (0.5 * loss_fn(model, xl[:h], yl[:h])).backward()
                (0.5 * loss_fn(model, xl[h:], yl[h:])).backward()
        else:
            loss_fn(d, xl, yl).backward()
            loss_fn(t, xl, yl).backward()
        loss_fn(ref, x, y).backward()
        errs["grad_vs_torch"] = worst(errs["grad_vs_torch"], _max_diff(mine, theirs, grads=True))
        errs["views"] &= views()
        n1 = d.clip_grad_norm_(0.05)
        n2 = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        errs["norm"] = worst(errs["norm"], abs(n1.item() - n2.item()))
        for o in opts:
            o.step()
    errs["params_vs_torch"] = _max_diff(mine, theirs)
    errs["params_vs_single"] = _max_diff(mine, ref)
    return errs


def _unused_and_overlap(dims, overlap: bool = True) -> dict:
    from distllm.parallel import DistributedDataParallel

    model, ref = make(unused=True, h=64, f=256, n=4), make(unused=True, h=64, f=256, n=4)
    d = DistributedDataParallel(model, dims=dims, bucket_cap_mb=0.05, find_unused_parameters=True,
                                overlap_grad_reduce=overlap)
    last = {}

    def mark_end(_p) -> None:  # inp.weight's gradient is the last to land
        last["t"] = time.perf_counter()

    model.inp.weight.register_post_accumulate_grad_hook(mark_end)
    x, y = batch(0)
    xl, yl = local(x, dims), local(y, dims)
    use = dims.dp_rank == 0
    d.reducer.start_cycle_log()
    loss_fn(d, xl, yl, use_extra=use).backward()  # `extra` used on rank 0, `never` nowhere
    log, in_backward = list(d.reducer.launch_log), d.reducer.launches_in_backward
    before_end = sum(t < last["t"] for _, t, _ in log)
    d.finish_grad_sync()  # idempotent
    # expected: the DP average of every rank's local gradient (zeros where a rank did not
    # use it), and None where no rank did (`never`), as torch DDP leaves it
    loss_fn(ref, xl, yl, use_extra=use).backward()
    err = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p is model.never:
            err = worst(err, 0.0 if p.grad is None else float("inf"))
            continue
        g = q.grad.clone() if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(g, group=dims.dp_group)
        err = worst(err, (p.grad - g / dims.dp).abs().max().item())
    # AdamW with weight decay leaves the parameter no rank used alone, step after step (a
    # zero gradient would decay it)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = model.never.detach().clone()
    for _ in range(2):
        opt.step()
        d.zero_grad()
        loss_fn(d, xl, yl, use_extra=use).backward()
    err = worst(err, (model.never - before).abs().max().item(),
              0.0 if model.never.grad is None else float("inf"))
    # a gradient carried over (no zero_grad) to a step that does not use the parameter
    # stays, as torch DDP leaves it (it was set to None)
    model.never.grad = torch.full_like(model.never, 0.5)
    loss_fn(d, xl, yl, use_extra=use).backward()
    err = worst(err, float("inf") if model.never.grad is None else
              (model.never.grad - 0.5).abs().max().item())
    # ... but not after a forward that no backward followed, once zero_grad dropped it
    model.never.grad = torch.full_like(model.never, 0.5)
    d(xl)
    d.zero_grad()
    loss_fn(d, xl, yl, use_extra=use).backward()
    err = worst(err, 0.0 if model.never.grad is None else float("inf"))
    return {"unused_err": err, "buckets": len(d.bucket_sizes), "first_hooks": log[0][2],
            "nparams": len(list(model.parameters())) - 1,
            "before_end": before_end,
            "in_backward": in_backward}


class _TwoHeads(nn.Module):
    """A trunk and two heads; a batch uses one of them. ``head_b`` is registered last, so
    its parameters fill the first buckets, which a rank that does not use it marks ready in
    forward (and, with overlap, reduces there)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(7, 16)
        self.head_a = nn.Linear(16, 5)
        self.head_b = nn.Sequential(nn.Linear(16, 200), nn.Linear(200, 5))

    def forward(self, x, task: str):  # (b, s, 7) -> (b, s, 5)
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if task == "a" else self.head_b(h)


def _rank_dependent_heads(dims) -> float:
    """find_unused_parameters where ranks use different heads (rank 0 head_a, the others
    head_b), overlap on: two steps of AdamW against one process on every rank's rows."""
    from distllm.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _TwoHeads().double()
    ref = _TwoHeads().double()
    ref.load_state_dict(model.state_dict())
    d = DistributedDataParallel(model, dims=dims, bucket_cap_mb=0.01,
                                find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    tasks = ["a" if r == 0 else "b" for r in range(dims.dp)]
    for step in range(2):
        x, y = batch(step)
        loss_fn(d, local(x, dims), local(y, dims), task=tasks[dims.dp_rank]).backward()
        n = x.shape[0] // dims.dp
        sum(loss_fn(ref, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n], task=t)
            for r, t in enumerate(tasks)).div(dims.dp).backward()
        opt.step()
        ropt.step()
        d.zero_grad()
        ropt.zero_grad()
    return _max_diff(model, ref)


def _unused_head_kept_as_none(dims) -> dict:
    """A head no rank uses, zero_grad(set_to_none=False) between steps (as torch's DDP and
    nn.Module.zero_grad: its .grad stays None), AdamW with weight decay: three steps against
    one process; the unused head never moves (it was given a zero gradient and decayed)."""
    from distllm.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _TwoHeads().double()
    ref = _TwoHeads().double()
    ref.load_state_dict(model.state_dict())
    b0 = model.head_b[0].weight.detach().clone()
    d = DistributedDataParallel(model, dims=dims, bucket_cap_mb=0.01,
                                find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(3):
        d.zero_grad(set_to_none=False)
        ropt.zero_grad(set_to_none=False)
        x, y = batch(step)
        loss_fn(d, local(x, dims), local(y, dims), task="a").backward()
        loss_fn(ref, x, y, task="a").backward()
        grads.append(model.head_b[0].weight.grad is None)
        opt.step()
        ropt.step()
    return {"diff": _max_diff(model, ref), "none": grads,
            "moved": (model.head_b[0].weight - b0).abs().max().item()}


def _auto(dims) -> dict:
    """``overlap_grad_reduce="auto"`` through its trial and past it: AdamW steps with weight
    decay and clipping against one process on the global batch; how each cycle was planned
    and whether its buckets launched from backward; and, at ZeRO stages 1 and 2, whether a
    trial runs (all-reduce mode only)."""
    from distllm.parallel import DistributedDataParallel, ZeroOptimizer
    from distllm.parallel.data.reduction_trial import trial_cycles

    mine, ref = make(), make()
    d = DistributedDataParallel(mine, dims=dims, bucket_cap_mb=0.002, first_bucket_mb=0.0005,
                                overlap_grad_reduce="auto")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (mine, ref)]
    planned, launched = [], []
    for s in range(trial_cycles() + 2):
        x, y = batch(s)
        d.zero_grad()
        opts[1].zero_grad()
        planned.append(d.reducer.overlap)
        d.reducer.start_cycle_log()
        loss_fn(d, local(x, dims), local(y, dims)).backward()
        launched.append(d.reducer.launches_in_backward > 0)
        loss_fn(ref, x, y).backward()
        d.clip_grad_norm_(0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        for o in opts:
            o.step()
    t = d.reducer.trial
    stages = {}
    for stage in (1, 2):
        z = ZeroOptimizer(make(), torch.optim.AdamW, stage=stage, dims=dims,
                          overlap_grad_reduce="auto")
        stages[stage] = (z.reducer.trial is not None, z.reducer.overlap)
    return {"planned": planned, "launched": launched, "decision": t.decision,
            "reason": t.reason, "err": _max_diff(mine, ref), "stages": stages,
            "buckets": len(d.bucket_sizes)}


class TPToy(nn.Module):
    """A row-sharded weight (tensor_model_parallel) and a replicated bias; the loss makes
    their gradients exactly ``rows`` and ``gb``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
        self.w.tensor_model_parallel = True
        self.b = nn.Parameter(torch.zeros(5, dtype=torch.float64))

    def forward(self, rows, gb):
        return (self.w * rows).sum() + (self.b * gb).sum()


def _tp_clip() -> dict:
    """Clipping across TP: a row-sharded weight (tensor_model_parallel) + a replicated bias."""
    from distllm import ParallelDims
    from distllm.parallel import DistributedDataParallel, ZeroOptimizer
    from distllm.parallel.data import clip_grad_norm_

    dims = ParallelDims(tp=2)
    g = torch.Generator().manual_seed(3)
    gw, gb = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(5, generator=g,
                                                                              dtype=torch.float64)
    want = torch.sqrt(gw.square().sum() + gb.square().sum()).item()
    rows = gw[dims.tp_rank * 4: (dims.tp_rank + 1) * 4]
    out = {}
    for kind in ("ddp", "zero0", "zero2", "zero3"):
        m = TPToy()
        if kind == "ddp":
            DistributedDataParallel(m, dims=dims)
            m(rows, gb).backward()
            norm = clip_grad_norm_(m.parameters(), 0.5, dims=dims)
            clipped = clip_grad_norm_(m.parameters(), 1e9, dims=dims).item()  # norm after
        else:
            z = ZeroOptimizer(m, torch.optim.SGD, stage=int(kind[-1]), dims=dims, lr=0.1)
            m(rows, gb).backward()
            norm = z.clip_grad_norm_(0.5)
            clipped = z.clip_grad_norm_(1e9).item()
        out[kind] = (norm.item(), want, clipped)
    # the step's one all-reduce: the norm's squares with other values summed over the world
    # (DDP replicas hold the same gradients; ZeRO adds its inf/NaN flags)
    extra = torch.tensor([dist.get_rank() + 1.0, 0.5], dtype=torch.float64)
    for kind in ("ddp_sum", "zero2_check"):
        m = TPToy()
        if kind == "ddp_sum":
            d = DistributedDataParallel(m, dims=dims)
            m(rows, gb).backward()
            norm, summed = d.clip_grad_norm_and_sum_(0.5, extra)
            clipped = clip_grad_norm_(m.parameters(), 1e9, dims=dims).item()
        else:
            z = ZeroOptimizer(m, torch.optim.SGD, stage=2, dims=dims, lr=0.1)
            m(rows, gb).backward()
            norm, flag, summed = z.clip_and_check(0.5, extra)
            clipped = z.clip_grad_norm_(1e9).item()
            summed = torch.cat([summed, flag.reshape(1).to(summed.dtype)])
        out[kind] = (norm.item(), want, clipped)
        out[kind + "_summed"] = summed.tolist()
    return out


def _zero_dp1(dims) -> float:
    """ZeRO with dp == 1: the 'shards' are the whole model; equals plain AdamW."""
    from distllm.parallel import ZeroOptimizer

    err = 0.0
    for stage in (1, 2, 3):
        m, ref = make(), make()
        z = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, dims=dims, lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for s in range(2):
            x, y = batch(s)
            z.zero_grad()
            ropt.zero_grad()
            loss_fn(m, x, y).backward()
            loss_fn(ref, x, y).backward()
            z.step()
            ropt.step()
        sd = z.state_dict()
        err = worst(err, worst((sd["master"][n] - p).abs().max().item()
                           for n, p in ref.named_parameters()))
    return err


def _buffers_as_torch_ddp(dims) -> dict:
    """A BatchNorm's running statistics under distllm DDP and torch DDP, each rank on its own
    data: steps of two micro-batches (the first under no_sync), then a forward without
    grad. torch DDP broadcasts rank 0's buffers before the first forward and each one after a
    synchronised forward (the first micro-batch of a step, and the last forward here); the
    largest difference of the buffers from torch DDP's (0: the same), and whether they
    differ over the ranks at the end (as they do where each rank's last forward ran on its
    own data)."""
    from distllm.parallel import DistributedDataParallel

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 5, dtype=torch.float64),
                             nn.BatchNorm1d(5, dtype=torch.float64),
                             nn.Linear(5, 1, dtype=torch.float64))

    mine, theirs = model(), model()
    d = DistributedDataParallel(mine, dims=dims)
    t = nn.parallel.DistributedDataParallel(theirs, process_group=dims.dp_group)
    g = torch.Generator().manual_seed(100 + dims.dp_rank)
    for _ in range(3):
        for w in (d, t):
            w.zero_grad()
        for micro in range(2):
            x = torch.randn(8, 6, generator=g, dtype=torch.float64)
            for w in (d, t):
                with w.no_sync() if micro == 0 else contextlib.nullcontext():
                    w(x).square().mean().backward()
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    with torch.no_grad():
        d(x)
        t(x)
    diff = worst((a.double() - b.double()).abs().max().item()
                 for a, b in zip(mine.buffers(), theirs.buffers(), strict=True))
    mean = mine[1].running_mean.clone()
    means = [torch.empty_like(mean) for _ in range(dims.dp)]
    dist.all_gather(means, mean, group=dims.dp_group)
    return {"vs_torch": diff, "ranks_differ": not all(torch.equal(m, means[0]) for m in means)}


def ddp_scenarios() -> dict:
    """Every DP scenario on this world: parity and unused parameters on the DP group; at
    world 4, clipping across tp=2; at world 2, dp == 1 (tp=2 over 2 ranks)."""
    from distllm import ParallelDims
    from distllm.parallel import DistributedDataParallel

    dims = ParallelDims()
    out = {"parity": _parity(dims), "unused": _unused_and_overlap(dims),
           "parity_after_backward": _parity(dims, overlap=False),
           "unused_after_backward": _unused_and_overlap(dims, overlap=False),
           "auto": _auto(dims), "rank_dependent_heads": _rank_dependent_heads(dims),
           "unused_head": _unused_head_kept_as_none(dims),
           "buffers": _buffers_as_torch_ddp(dims)}
    if dist.get_world_size() == 4:
        out["tp_clip"] = _tp_clip()
    else:  # dp == 1: a plain wrapper, gradients untouched
        dims1 = ParallelDims(tp=2)
        m, ref = make(), make()
        d = DistributedDataParallel(m, dims=dims1)
        x, y = batch(0)
        loss_fn(d, x, y).backward()
        loss_fn(ref, x, y).backward()
        d.finish_grad_sync()
        out["dp1"] = (d.reducer is None, _max_diff(m, ref, grads=True))
        d.zero_grad()  # no buckets: the next backward hands its gradients over
        out["dp1_zeroed_to_none"] = all(p.grad is None for p in m.parameters())
        out["dp1_zero"] = _zero_dp1(dims1)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what", ["grad_vs_torch", "norm", "params_vs_torch",
                                  "params_vs_single"])
@pytest.mark.parametrize("when", ["", "_after_backward"])
def test_ddp_matches_torch_ddp_and_single_process(spawned, world, what, when):
    for r in spawned(ddp_scenarios, world):
        e = r["parity" + when][what]
        assert e < TOL, f"{what}: {e:.3g}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("when", ["", "_after_backward"])
def test_unused_parameters_get_the_average(spawned, world, when):
    for r in spawned(ddp_scenarios, world):
        u = r["unused" + when]
        assert u["unused_err"] < TOL, u


@pytest.mark.parametrize("world", [2, 4])
def test_buffers_follow_rank_0_at_each_synchronised_forward_as_torch_ddp(spawned, world):
    for r in spawned(ddp_scenarios, world):
        assert r["buffers"] == {"vs_torch": 0.0, "ranks_differ": True}, r["buffers"]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_using_different_parameters(spawned, world):
    # a rank that marks a bucket ready in forward reduces it before the others reach it in
    # backward: the use flags' all-reduce must come first on every rank
    for r in spawned(ddp_scenarios, world):
        assert r["rank_dependent_heads"] < TOL, r["rank_dependent_heads"]


@pytest.mark.parametrize("world", [2, 4])
def test_zero_grad_keeps_an_unused_parameters_grad_none(spawned, world):
    for r in spawned(ddp_scenarios, world):
        u = r["unused_head"]
        assert u["none"] == [True] * 3 and u["moved"] == 0.0 and u["diff"] < TOL, u


@pytest.mark.parametrize("world", [2, 4])
def test_reduction_overlaps_backward(spawned, world):
    for r in spawned(ddp_scenarios, world):
        u = r["unused"]
        assert u["buckets"] > 2 and u["first_hooks"] < u["nparams"], u
        assert u["before_end"] >= 1 and u["in_backward"] >= 2, u


@pytest.mark.parametrize("world", [2, 4])
def test_no_reduction_during_backward_when_overlap_is_off(spawned, world):
    for r in spawned(ddp_scenarios, world):
        u = r["unused_after_backward"]  # find_unused_parameters marks some ready in forward
        assert u["buckets"] > 2 and u["before_end"] == 0 and u["in_backward"] == 0, u


@pytest.mark.parametrize("world", [2, 4])
def test_auto_tries_both_reductions_then_keeps_one_everywhere(spawned, world):
    from distllm.parallel.data.reduction_trial import trial_cycles

    res = spawned(ddp_scenarios, world)
    n = trial_cycles()
    for r in res:
        a = r["auto"]
        assert a["err"] < TOL, a  # both schedules give the same gradients
        # an untimed overlapped cycle, then rounds of (during, after), (after, during), ...
        trial = [True] + [(k // 2) % 2 == k % 2 for k in range(n - 1)]
        assert a["planned"][:n] == trial and a["planned"][n:] == [a["decision"]] * 2, a
        assert a["launched"] == a["planned"] and a["buckets"] > 2, a  # as planned
        # ZeRO-1 (all-reduce) runs a trial; ZeRO-2 keeps the overlap (it frees its buckets)
        assert a["stages"] == {1: (True, True), 2: (False, True)}, a["stages"]
    assert len({r["auto"]["reason"] for r in res}) == 1, [r["auto"]["reason"] for r in res]


@pytest.mark.parametrize("kind", ["ddp", "zero0", "zero2", "zero3", "ddp_sum", "zero2_check"])
def test_clip_across_tp(spawned, kind):
    for r in spawned(ddp_scenarios, 4):
        norm, want, clipped = r["tp_clip"][kind]
        assert abs(norm - want) < TOL, f"{kind}: global norm {norm} != {want}"
        assert abs(clipped - 0.5) < 1e-6, f"{kind}: clipped norm {clipped}"


def test_norm_and_step_values_in_one_all_reduce(spawned):
    """The values reduced with the norm are summed over all 4 ranks (1+2+3+4, 4 x 0.5), and
    ZeRO's inf/NaN flag is clear."""
    for r in spawned(ddp_scenarios, 4):
        c = r["tp_clip"]
        assert c["ddp_sum_summed"] == [10.0, 2.0], c["ddp_sum_summed"]
        assert c["zero2_check_summed"] == [10.0, 2.0, 0.0], c["zero2_check_summed"]


def test_dp1_ddp_leaves_gradients_alone(spawned):
    for r in spawned(ddp_scenarios, 2):
        no_reducer, err = r["dp1"]
        assert no_reducer and err < TOL, r["dp1"]


@pytest.mark.parametrize("world", [2, 4])
def test_zero_grad_modes_and_bucket_views(spawned, world):
    for r in spawned(ddp_scenarios, world):
        e = r["parity"]
        assert e["views"], "after backward a .grad is not its bucket's view"
        assert e["zeroed_to_none"], "zero_grad() left gradients"
        assert e["zeroed_in_place"], "zero_grad(set_to_none=False) broke or did not zero the views"
        if world == 2:
            assert r["dp1_zeroed_to_none"], "dp=1 zero_grad() kept gradients to fill and add"


def test_dp1_zero_equals_plain_adamw(spawned):
    for r in spawned(ddp_scenarios, 2):
        assert r["dp1_zero"] < TOL, f"ZeRO with dp=1 off by {r['dp1_zero']:.3g}"


def test_bad_input():
    from distllm.parallel import DistributedDataParallel

    with pytest.raises(ValueError, match="no parameters"):
        DistributedDataParallel(nn.GELU(), dims=None)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        DistributedDataParallel(lambda x: x, dims=None)
    with pytest.raises(ValueError, match="dims=None"):
        DistributedDataParallel(make(), dims=None)
    mixed = make()
    mixed.head.to(torch.float32)
    with pytest.raises(ValueError, match="several dtypes"):
        DistributedDataParallel(mixed, dims=None)
    for name in ("bucket_cap_mb", "first_bucket_mb"):
        for bad in (0, -2.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"{name}={bad!r}: give a finite number of MB"):
                DistributedDataParallel(make(), dims=None, **{name: bad})
    with pytest.raises(ValueError, match="has no dp_group"):
        DistributedDataParallel(make(), dims=object())
    assert not dist.is_initialized()
