"""ZeRO-0/1/2/3 against a single process on the global batch (float64, ~1e-10) with the
trainer's default optimizer settings (AdamW with decay on matrices only, global-norm
clipping, warm-up), bf16 compute with fp32 masters against an fp32 AdamW, memory against the
ZeRO paper's model, gradient accumulation, unused parameters, inf/NaN skipping, checkpoint
round trip and overlap of the reduction with backward. One spawn per rank function and world
size; each scenario is its own test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._errors import worst
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
    set_lr,
    train_step,
)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache()


# --- parity with the single process ----------------------------------------------------------

CASES = {
    "adamw-s0": dict(stage=0),
    "adamw-s1": dict(stage=1),
    "adamw-s2": dict(stage=2),
    "adamw-s3": dict(stage=3),
    "adamw-s2-reduce-scatter": dict(stage=2, rs="reduce_scatter"),  # gloo's own collective
    "adamw-s3-no-prefetch": dict(stage=3, prefetch=False),
    "sgd-momentum-s2": dict(stage=2, sgd=True),  # any elementwise optimizer works
    # with the module, buckets large enough to hold both param groups: a rank's shard of a
    # bucket holds a run of each, which the inner optimizer steps as two tensors
    # (ZeroOptimizer.segments)
    "adamw-s1-shared-buckets": dict(stage=1, cap=1.0),
    "adamw-s2-shared-buckets": dict(stage=2, cap=1.0, module=True),
    # with the module and several buckets, step() steps the bucket of the first layer on its
    # own and launches its gather before stepping the others (stage 1 above does too)
    "adamw-s2-module": dict(stage=2, module=True),
    # every bucket reduced after backward (overlap_grad_reduce=False)
    "adamw-s2-after-backward": dict(stage=2, module=True, overlap_grad=False),
    "adamw-s3-after-backward": dict(stage=3, overlap_grad=False),
    # "auto" at stage 1: a trial alternates both reductions, then keeps one (14 steps)
    "adamw-s1-auto": dict(stage=1, overlap_grad="auto", steps=14),
}
# cases where a rank's shard of some bucket holds both param groups (stage 3: each layer is
# one bucket, its weights and its biases)
SPLIT = ("adamw-s1-shared-buckets", "adamw-s2-shared-buckets", "adamw-s3")
MOMENTS = {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}


def _run_case(dims, stage: int, sgd: bool = False, prefetch: bool = True,
              rs: str = "auto", steps: int = 3, cap: float = 0.002,
              module: bool = False, overlap_grad: bool | str = True) -> dict:
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    opt_cls, kw = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}) if sgd else (
        torch.optim.AdamW, adamw())
    if stage in (1, 3) or module:  # the module (gathers overlap forward); groups by keyword
        z = ZeroOptimizer(model, opt_cls, stage=stage, dims=dims, prefetch=prefetch,
                          param_groups=groups_of(model), bucket_cap_mb=cap,
                          overlap_grad_reduce=overlap_grad, **kw)
    else:  # named param groups, no module
        z = ZeroOptimizer(groups_of(model, named=True), opt_cls, stage=stage, dims=dims,
                          bucket_cap_mb=cap, reduce_scatter_impl=rs, **kw)
    ropt = opt_cls(groups_of(ref), **kw)
    norms = [train_step(z, ropt, model, ref, dims, s, base_lr=kw["lr"]) for s in range(steps)]
    sd = z.state_dict()
    refp = dict(ref.named_parameters())
    errs = {"master": max_err({k: sd["master"][k] for k in refp}, refp),
            "weights": max_err(z.full_state_dict(), refp),
            "norm": worst(abs(a - b) for a, b in norms)}
    for key in MOMENTS[opt_cls.__name__]:
        errs[key] = max_err({n: sd["state"][n][key] for n in refp},
                            {n: ropt.state[p][key] for n, p in refp.items()})
    return {"errs": errs, "ref_norms": [b for _, b in norms], "buckets": len(z.reducer.buckets),
            "in_backward": z.reducer.launches_in_backward,
            "trial_done": z.reducer.trial is not None and z.reducer.trial.done,
            "split_shards": sum(len(segs) > 1 for segs in z.bucket_segments),
            "first_stepped_alone": z._first_needed}


def zero_parity() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return {name: _run_case(dims, **spec) for name, spec in CASES.items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_zero_matches_single_process(spawned, case, world):
    results = [rank_res[case] for rank_res in spawned(zero_parity, world)]
    for res in results:
        # clipping is really exercised (the default max norm is reached)
        assert max(res["ref_norms"]) > OPT.grad_clip, res["ref_norms"]
        for what, e in res["errs"].items():
            assert e < TOL, f"{case}: {what} differs from the single process by {e:.3g}"
    if case in SPLIT:  # the case tests what it says: some shard holds two groups
        assert any(r["split_shards"] for r in results), [r["split_shards"] for r in results]
    if case in ("adamw-s1", "adamw-s2-module"):  # ... and here: the two-part step ran
        assert all(r["first_stepped_alone"] is not None for r in results)
    if case.endswith("-after-backward"):  # several buckets, none launched from backward
        assert all(r["buckets"] > 2 and r["in_backward"] == 0 for r in results), results
    if case == "adamw-s1-auto":  # the trial ran to its decision
        assert all(r["trial_done"] for r in results), results


# --- bf16 compute, fp32 masters -------------------------------------------------------------

BF16_TOL = 5e-7  # fp32 masters: 6e-8 measured (1 ulp; the global norm sums in another order)


def _bf16_masters(dims, stage: int, steps: int = 5, by_module: bool = True) -> dict:
    """bf16 parameters with fp32 masters (what the trainer runs for --dtype bfloat16) against
    a reference written out here: fp32 masters, a bf16 copy of them that computes each DP
    rank's gradients on that rank's rows (the same bf16 GEMMs), those gradients upcast and
    averaged (as the fp32 buckets do: a sum of two halves is exact at dp 2), clipped by torch
    and stepped by torch's AdamW, then cast back. Each rank's rows are its own, so a missing
    or wrong data-parallel reduction changes the result. ``by_module=False`` passes the
    param groups alone, as the trainer does for bf16 at stage 0."""
    from distllm.parallel import ZeroOptimizer

    model = make(dtype=torch.float32)
    masters = copy.deepcopy(model)  # the reference's fp32 masters
    z = ZeroOptimizer(model if by_module else groups_of(model, named=True), torch.optim.AdamW,
                      stage=stage, dims=dims, param_dtype=torch.bfloat16,
                      param_groups=groups_of(model) if by_module else None,
                      bucket_cap_mb=0.002, **adamw())
    ropt = torch.optim.AdamW(groups_of(masters), foreach=False, **adamw())
    half = copy.deepcopy(masters).bfloat16()  # the reference's bf16 compute copy
    ref_norms, norm_errs = [], []
    for step in range(steps):
        set_lr(step, z, ropt)
        x, y = batch(step, n=4 * dims.dp)  # 4 rows a DP rank
        x, y = x.float().bfloat16(), y.float().bfloat16()
        z.zero_grad()
        (2 * loss_fn(model, local(x, dims), local(y, dims))).backward()  # (doubled: clipping
        for m in masters.parameters():  # acts on every step)
            m.grad = torch.zeros_like(m)
        for r in range(dims.dp):  # rank r's bf16 gradients, each over rank r's rows
            half.zero_grad()
            rows = slice(4 * r, 4 * (r + 1))
            (2 * loss_fn(half, x[rows], y[rows])).backward()
            for m, h in zip(masters.parameters(), half.parameters(), strict=True):
                m.grad += h.grad.float() / dims.dp
        ref_norms.append(torch.nn.utils.clip_grad_norm_(masters.parameters(), OPT.grad_clip))
        norm_errs.append(abs(z.clip_grad_norm_(OPT.grad_clip).item() - ref_norms[-1].item())
                         / ref_norms[-1].item())
        z.step()
        ropt.step()
        with torch.no_grad():
            for h, m in zip(half.parameters(), masters.parameters(), strict=True):
                h.copy_(m)
    z.wait_params()
    sd = z.state_dict()
    refp = dict(masters.named_parameters())
    return {"master": max_err({k: sd["master"][k].float() for k in refp}, refp),
            "weights": max_err({k: v.float() for k, v in z.full_state_dict().items()},
                               {k: v.float() for k, v in half.named_parameters()}),
            "exp_avg_sq": max_err({n: sd["state"][n]["exp_avg_sq"] for n in refp},
                                  {n: ropt.state[p]["exp_avg_sq"] for n, p in refp.items()}),
            "norm": worst(norm_errs), "ref_norms": [float(n) for n in ref_norms],
            "moved": max_err(refp, dict(make(dtype=torch.float32).named_parameters()))}


def bf16_parity() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return {**{stage: _bf16_masters(dims, stage) for stage in (0, 1, 2, 3)},
            "0-groups": _bf16_masters(dims, 0, by_module=False)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "0-groups"])
def test_bf16_masters_match_an_fp32_adamw(spawned, stage):
    """The trainer's bf16 path at the default settings (decay on matrices, clipping that acts
    on every step, warm-up then decay): the fp32 masters, Adam's second moments and the bf16
    weights are the reference's, far tighter than a bf16 training run can be compared."""
    for r in spawned(bf16_parity, 2):
        r = r[stage]
        assert min(r["ref_norms"]) > OPT.grad_clip, r["ref_norms"]
        assert r["moved"] > 1e-3, r  # the masters moved from where they started
        for what in ("master", "exp_avg_sq", "norm"):
            assert r[what] < BF16_TOL, f"stage {stage}: {what} off by {r[what]:.3g}"
        assert r["weights"] == 0.0, f"stage {stage}: bf16 weights off by {r['weights']:.3g}"


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
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims,
                          param_groups=groups_of(model), bucket_cap_mb=0.002, **adamw())
        ropt = torch.optim.AdamW(groups_of(ref), **adamw())
        set_lr(0, z, ropt)
        x, y = batch(0)
        xl, yl = local(x, dims), local(y, dims)
        h = xl.shape[0] // 2
        with z.no_sync():
            (0.5 * loss_fn(model, xl[:h], yl[:h])).backward()
        (0.5 * loss_fn(model, xl[h:], yl[h:], use_extra=dims.dp_rank == 0)).backward()
        z.clip_grad_norm_(OPT.grad_clip)
        z.step()
        # the reference: rank 0's second half also goes through `extra` (scaled to the mean)
        n = x.shape[0] // dims.dp
        ref_loss = loss_fn(ref, x, y)
        ye = ref(x[n // 2: n], use_extra=True) - ref(x[n // 2: n])
        extra = (ref(x[n // 2: n]) + ye - y[n // 2: n]).pow(2).mean() - loss_fn(
            ref, x[n // 2: n], y[n // 2: n])
        (ref_loss + extra * 0.5 / dims.dp).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip)
        ropt.step()
        sd = z.state_dict()
        out[stage] = worst((sd["master"][k] - p).abs().max().item()
                         for k, p in ref.named_parameters())
    return out


def _skip_and_reload(dims) -> dict:
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    z = ZeroOptimizer(groups_of(model, named=True), torch.optim.AdamW, stage=2, dims=dims,
                      bucket_cap_mb=0.002, **adamw())
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    train_step(z, ropt, model, ref, dims, 0)
    # a NaN on one rank only: every rank skips (clipping first, as the trainer does)
    x, y = batch(1)
    z.zero_grad()
    scale = float("nan") if dims.dp_rank == dims.dp - 1 else 1.0
    (scale * loss_fn(model, local(x, dims), local(y, dims))).backward()
    z.clip_grad_norm_(OPT.grad_clip)
    stepped = z.step()
    # checkpoint into a stage-1 and a stage-3 optimizer, and a stage-2 one whose buckets hold
    # both param groups (its shards' moments split between two tensors), then one more step
    # each (it reads the loaded moments)
    sd = z.state_dict()
    errs = {}
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    ropt_state = ropt.state_dict()
    for key, stage, cap in ((1, 1, 0.001), (3, 3, 0.001), ("2-shared-buckets", 2, 1.0)):
        m2, r2 = make(seed=5), make()
        r2.load_state_dict(ref_state)
        ropt2 = torch.optim.AdamW(groups_of(r2), **adamw())
        ropt2.load_state_dict(copy.deepcopy(ropt_state))  # load shares the tensors
        z2 = ZeroOptimizer(m2, torch.optim.AdamW, stage=stage, dims=dims,
                           param_groups=groups_of(m2), bucket_cap_mb=cap, **adamw())
        z2.load_state_dict(sd)
        train_step(z2, ropt2, m2, r2, dims, 1)
        sd2 = z2.state_dict()
        errs[key] = worst((sd2["master"][k] - p).abs().max().item()
                        for k, p in r2.named_parameters())
    return {"stepped": stepped, "skipped": z.skipped_steps, "reload": errs}


def _loss_scale(dims) -> dict:
    """Dynamic loss scaling: a scaled loss gives the unscaled gradient norm and update; an
    overflow halves the scale and skips the step. (The update alone would not tell: clipped,
    a gradient left scaled by 65536 moves AdamW's weights the same.)"""
    from distllm.parallel import ZeroOptimizer

    model, ref = make(), make()
    z = ZeroOptimizer(model, torch.optim.AdamW, stage=1, dims=dims, loss_scale="dynamic",
                      param_groups=groups_of(model), **adamw())
    ropt = torch.optim.AdamW(groups_of(ref), **adamw())
    set_lr(0, z, ropt)
    x, y = batch(0)
    s0 = z.loss_scale
    z.scale_loss(loss_fn(model, local(x, dims), local(y, dims))).backward()
    norm = z.clip_grad_norm_(OPT.grad_clip).item()
    z.step()
    loss_fn(ref, x, y).backward()
    norm -= torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip).item()
    ropt.step()
    z.wait_params()  # the parameter all-gather overlaps the next forward; read after waiting
    err = worst((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(),
                                                         strict=True))
    z.zero_grad()
    z.scale_loss(float("inf") * loss_fn(model, local(x, dims), local(y, dims))).backward()
    stepped = z.step()
    return {"err": err, "norm": abs(norm), "halved": z.loss_scale == s0 / 2,
            "stepped": stepped, "skipped": z.skipped_steps}


def _overlap(dims) -> dict:
    """Record when each bucket's reduction starts against backward's progress."""
    import time

    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage, groups, ogr in ((1, False, True), (2, False, True), (3, False, True),
                               (1, True, True), (2, True, True), (2, False, False),
                               (3, False, False)):
        # groups: the trainer's (decay, no decay), which share the buckets at stages 1-2;
        # ogr: overlap_grad_reduce
        model = make(h=64, f=256, n=4)
        kw = dict(param_groups=groups_of(model)) if groups else {}
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims, bucket_cap_mb=0.05,
                          overlap_grad_reduce=ogr, **kw)
        last = {}
        def mark_end(_p, last=last) -> None:  # inp.weight's gradient is the last to land
            last["t"] = time.perf_counter()

        model.inp.weight.register_post_accumulate_grad_hook(mark_end)
        z.reducer.start_cycle_log()
        x, y = batch(0)
        loss_fn(model, local(x, dims), local(y, dims)).backward()
        log = z.reducer.launch_log
        nparams = len(list(model.parameters()))
        name = f"{stage}-groups" if groups else stage if ogr else f"{stage}-after-backward"
        out[name] = {
                      "buckets": len(z.reducer.buckets), "first_hooks": log[0][2],
                      "nparams": nparams, "before_end": sum(t < last["t"] for _, t, _ in log),
                      "in_backward": z.reducer.launches_in_backward}
        z.step()
    return out


def _groups_after_shard(dims) -> str:
    """The trainer's decay groups are decided from shapes: once ZeRO-3 has sharded the
    parameters (empty 1-D tensors) deciding them again must fail, not put every matrix in the
    no-decay group."""
    from distllm.parallel import ZeroOptimizer
    from distllm.train.engine import _decay_groups

    model = make()
    ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims, param_groups=groups_of(model))
    try:
        _decay_groups(list(model.named_parameters()), OPT.weight_decay)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _module_zero_grad(dims) -> dict:
    """Two steps cleared with ``model.zero_grad()`` (as a torch DDP script does), not the
    optimizer's: at stages 2-3 the shards are no parameter's .grad, and the second step
    stepped on the sum of both steps' gradients. AdamW with the default settings against
    the single process."""
    from distllm.parallel import ZeroOptimizer

    out = {}
    for stage in (0, 1, 2, 3):
        model, ref = make(), make()
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims,
                          param_groups=groups_of(model), **adamw())
        ropt = torch.optim.AdamW(groups_of(ref), **adamw())
        for step in range(2):
            x, y = batch(step)
            loss_fn(model, local(x, dims), local(y, dims)).backward()
            z.step()
            model.zero_grad()
            loss_fn(ref, x, y).backward()
            ropt.step()
            ref.zero_grad()
        out[stage] = max_err(z.full_state_dict(), dict(ref.named_parameters()))
    return out


def zero_extras() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims()
    return {"memory": _memory(dims), "accum": _accumulation(dims),
            "skip": _skip_and_reload(dims), "overlap": _overlap(dims),
            "scale": _loss_scale(dims), "groups": _groups_after_shard(dims),
            "module_zero_grad": _module_zero_grad(dims)}


@pytest.mark.parametrize("grad_bytes", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_zero_model(spawned, stage, grad_bytes):
    for r in spawned(zero_extras, 2):
        got, want, slack = r["memory"][(stage, grad_bytes)]
        assert abs(got - want) <= slack, (
            f"stage {stage}, {grad_bytes}-byte grads: {got} bytes held, ZeRO model says {want:.0f}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation_with_unused_params(spawned, stage):
    for r in spawned(zero_extras, 2):
        e = r["accum"][stage]
        assert e < TOL, f"stage {stage}: no_sync accumulation + unused params off by {e:.3g}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_consumes_the_sharded_gradients(spawned, stage):
    for r in spawned(zero_extras, 2):
        e = r["module_zero_grad"][stage]
        assert e < TOL, f"stage {stage}, cleared by model.zero_grad(): off by {e:.3g}"


def test_nan_on_one_rank_skips_the_step_everywhere(spawned):
    for r in spawned(zero_extras, 2):
        assert r["skip"]["stepped"] is False and r["skip"]["skipped"] == 1, r["skip"]


@pytest.mark.parametrize("stage", [1, 3, "2-shared-buckets"])
def test_checkpoint_reloads_into_another_stage(spawned, stage):
    for r in spawned(zero_extras, 2):
        e = r["skip"]["reload"][stage]
        assert e < TOL, f"reload of a stage-2 checkpoint into stage {stage}: off by {e:.3g}"


def test_dynamic_loss_scale(spawned):
    for r in spawned(zero_extras, 2):
        sc = r["scale"]
        assert sc["err"] < TOL and sc["norm"] < TOL, sc
        assert sc["halved"] and not sc["stepped"] and sc["skipped"] == 1, sc


@pytest.mark.parametrize("stage", [1, 2, 3, "1-groups", "2-groups"])
def test_reduction_overlaps_backward(spawned, stage):
    for r in spawned(zero_extras, 2):
        o = r["overlap"][stage]
        assert o["buckets"] > 2, o
        # the first bucket holds the last layers' gradients (none of the first layers', which
        # land at the end of backward): its reduction starts within the first half
        assert o["first_hooks"] < o["nparams"] // 2, f"stage {stage}: launched late {o}"
        # and most buckets start before the first layer's gradient lands
        assert o["before_end"] >= o["buckets"] // 2 and o["in_backward"] >= 2, \
            f"stage {stage}: {o}"


@pytest.mark.parametrize("stage", [2, 3])
def test_reduction_after_backward_when_overlap_is_off(spawned, stage):
    for r in spawned(zero_extras, 2):
        o = r["overlap"][f"{stage}-after-backward"]
        # every bucket launched once the first layer's gradient has landed, none from a hook
        assert o["buckets"] > 2 and o["before_end"] == 0 and o["in_backward"] == 0, o


def test_decay_groups_refuse_sharded_parameters(spawned):
    for r in spawned(zero_extras, 2):
        assert "before ZeroOptimizer(stage=3) shards" in r["groups"], r["groups"]


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
    with pytest.raises(ValueError, match="param_groups= is only read with an nn.Module"):
        ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=1, dims=None,
                      param_groups=[{"params": list(m.parameters()), "weight_decay": 0.1}])
    with pytest.raises(ValueError, match="stage=3 needs the nn.Module"):
        ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=3, dims=None)
    with pytest.raises(ValueError, match="dims=None"):
        ZeroOptimizer(m, torch.optim.AdamW, stage=1, dims=None)
    with pytest.raises(ValueError, match="has no dp_group"):
        ZeroOptimizer(m, torch.optim.AdamW, stage=1, dims=object())
    for cap in (0, -1.0, float("nan"), float("inf"), None):  # at stage 3 too (it has no use)
        with pytest.raises(ValueError, match=rf"bucket_cap_mb={cap!r}: give a finite number "
                                             r"of MB > 0 \(25 is the default\)"):
            ZeroOptimizer(m, torch.optim.AdamW, stage=3, dims=None, bucket_cap_mb=cap)
    with pytest.raises(ValueError, match="param group 1 has no 'params': give every group"):
        ZeroOptimizer([{"params": [m.inp.weight]}, {"lr": 0.1}], torch.optim.AdamW, stage=1,
                      dims=None)
    assert not dist.is_initialized()


def test_all_finite_reads_inf_and_nan_and_never_overflows():
    from distllm.parallel.data.grad_norm import all_finite

    big = torch.full((1000,), 3.0e38)  # finite float32 whose float32 sum would overflow
    assert bool(all_finite(big)) and bool(all_finite(-big))
    for bad in (float("inf"), float("-inf"), float("nan")):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            t = torch.zeros(7, dtype=dtype)
            t[3] = bad
            assert not bool(all_finite(t)), (bad, dtype)
    assert bool(all_finite(torch.full((3,), 1e300, dtype=torch.float64)))  # exact at fp64
    pair = torch.tensor([float("inf"), float("-inf")])  # sums to nan: still flagged
    assert not bool(all_finite(pair))


class _FusedPair(nn.Module):
    """A layer that uses its two linears' weights without calling them (as a fused MLP)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x):
        y = torch.tanh(nn.functional.linear(x, self.a.weight, self.a.bias))
        return nn.functional.linear(y, self.b.weight, self.b.bias)


class _FusedStack(nn.Module):
    def __init__(self, h: int = 9, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_FusedPair(h) for _ in range(n))
        self.head = nn.Linear(h, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def gather_waits() -> dict:
    """Stages 1-2: after a step every bucket's parameter gather is in flight; when a layer's
    forward starts, none holding a parameter of its subtree still is (its children are
    never called), and the losses follow a plain single-process AdamW."""
    from distllm import ParallelDims
    from distllm.parallel import ZeroOptimizer

    dims = ParallelDims()
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = _FusedStack().double()
        ref = copy.deepcopy(model)
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims, lr=0.1,
                          bucket_cap_mb=1e-4)  # about one parameter per bucket
        ropt = torch.optim.AdamW(ref.parameters(), lr=0.1)
        where = {p: b.index for b in z.reducer.buckets for p in b.params}
        seen: dict[int, list[int]] = {}

        def record(mod, _args, i, where=where, seen=seen, z=z) -> None:
            mine = {where[p] for p in mod.parameters()}
            seen.setdefault(i, []).append(len(mine & set(z._gathers.pending)))

        for i, blk in enumerate(model.blocks):
            blk.register_forward_pre_hook(lambda m, a, i=i: record(m, a, i))
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(3, 2 * dims.dp, 9, generator=g, dtype=torch.float64)
        err, pending_after_step = 0.0, []
        for x in xs:
            mine = x[2 * dims.dp_rank: 2 * dims.dp_rank + 2]
            loss = model(mine).square().mean()
            loss.backward()
            z.step()
            pending_after_step.append(len(z._gathers.pending))
            z.zero_grad()
            ropt.zero_grad()
            ref(x).square().mean().backward()
            ropt.step()
        z.wait_params()
        err = worst((p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                               ref.parameters(), strict=True))
        out[stage] = {"pending_after_step": pending_after_step, "seen": seen, "err": err,
                      "buckets": len(z.reducer.buckets)}
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_a_layer_waits_for_its_whole_subtree_gathers(spawned, stage):
    for r in spawned(gather_waits, 2):
        res = r[stage]
        assert res["buckets"] >= 7, res
        assert res["pending_after_step"] == [res["buckets"]] * 3, res  # all launched, in flight
        assert all(v == [0, 0, 0] for v in res["seen"].values()), res
        assert res["err"] < TOL, res


def fused_mlp_units() -> dict:
    """A ``Sequential`` of Linear -> GELU -> Linear -> GELU -> Linear after
    :func:`distllm.nn.fuse` (a fused Linear + GeLU, then a fused MLP): the MLP's head computes
    the last Linear's GEMM too, and that Linear is another unit (a child of the same
    ``Sequential``). Every stage: clipped
    AdamW steps follow a single process in float64; at the head's forward no gather of the
    second Linear's parameters is still in flight (stages 1-2), and at stage 3 they are not
    sharded there (it crashed on a 1-D shard before)."""
    from distllm import ParallelDims
    from distllm.nn import fuse
    from distllm.parallel import ZeroOptimizer

    dims = ParallelDims()
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(9, 12), nn.GELU(), nn.Linear(12, 9), nn.GELU(),
                              nn.Linear(9, 1)).double()
        ref = copy.deepcopy(model)
        swapped = fuse(model)
        z = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, dims=dims,
                          bucket_cap_mb=1e-4, **adamw(weight_decay=0.1))
        ropt = torch.optim.AdamW(ref.parameters(), **adamw(weight_decay=0.1))
        tail = [model[4].weight, model[4].bias]
        seen = []

        def record(_mod, _args, z=z, tail=tail, seen=seen, stage=stage) -> None:
            if stage < 3:
                where = {p: b.index for b in z.reducer.buckets for p in b.params}
                seen.append(len({where[p] for p in tail} & set(z._gathers.pending)))
            else:
                seen.append(sum(p.numel() for p in tail))

        model[2].register_forward_pre_hook(record)
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(3, 2 * dims.dp, 9, generator=g, dtype=torch.float64)
        for x in xs:
            z.zero_grad()
            ropt.zero_grad()
            model(local(x, dims)).square().mean().backward()  # gradients: the ranks' mean
            ref(x).square().mean().backward()
            z.clip_grad_norm_(OPT.grad_clip)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), OPT.grad_clip)
            z.step()
            ropt.step()
        full = z.full_state_dict()
        err = max_err(full, ref.state_dict())
        out[stage] = {"swapped": swapped, "seen": seen, "err": err,
                      "tail": sum(p.numel() for p in ref[4].parameters())}
    return out


def test_a_fused_mlp_split_over_two_units_reads_its_second_linear_gathered(spawned):
    for r in spawned(fused_mlp_units, 2):
        for stage, res in r.items():
            assert res["swapped"] == 2, res
            want = [0, 0, 0] if stage < 3 else [res["tail"]] * 3
            assert res["seen"] == want, (stage, res)
            assert res["err"] < TOL, (stage, res)
