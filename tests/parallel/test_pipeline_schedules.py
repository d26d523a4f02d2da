"""Schedules and the simulator, without processes, over a (pp, m, v) grid."""

from __future__ import annotations

import itertools

import pytest

from distllm.parallel.pipeline import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    forward_only_schedule,
    simulate,
    split_layers,
    validate,
)
from distllm.parallel.pipeline.schedules import with_comms

PPS, MS, VS = (1, 2, 3, 4, 8), (1, 2, 3, 4, 5, 7, 8, 16), (1, 2, 3)


def grid():
    for name, p, m, v in itertools.product(SCHEDULES, PPS, MS, VS):
        if v > 1 and name != "interleaved-1f1b":
            continue
        if name == "interleaved-1f1b" and (m % p or (p > 1 and v == 1)):
            continue
        yield name, p, m, v


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_completes_without_deadlock(name):
    n = 0
    for nm, p, m, v in grid():
        if nm != name:
            continue
        s = build_schedule(name, p, m, v)
        validate(s)
        r = simulate(s, 1.0 / v, 1.0 / v, 1.0 / v, t_comm=0.05)
        assert r.deadlock == [], (name, p, m, v, r.deadlock)
        assert r.fifo_ok, (name, p, m, v)  # receives in send order per pair (NCCL)
        busy = m * 3.0  # every rank runs F + B + W of every micro-batch through every chunk
        assert all(abs(b - busy) < 1e-9 for b in r.busy)
        assert r.step_time >= busy
        n += 1
    assert n > 10


def test_bubble_formula_gpipe_1f1b():
    for name, p, m in itertools.product(("gpipe", "1f1b"), PPS, MS):
        for tf, tb, tw in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.3, 0.5, 0.2)):
            r = simulate(build_schedule(name, p, m), tf, tb, tw, t_comm=0.0)
            ideal = (p - 1) / (m + p - 1)
            assert r.step_time == pytest.approx((m + p - 1) * (tf + tb + tw), abs=1e-9)
            assert max(r.bubble) == pytest.approx(ideal, abs=1e-9), (name, p, m)
            assert min(r.bubble) == pytest.approx(ideal, abs=1e-9), (name, p, m)


def test_peak_activations_1f1b_vs_gpipe():
    for p, m in itertools.product(PPS, MS):
        g = simulate(build_schedule("gpipe", p, m))
        o = simulate(build_schedule("1f1b", p, m))
        assert g.peak_activations == [float(m)] * p
        assert o.peak_activations == [float(min(p - r, m)) for r in range(p)]
        assert max(o.peak_activations) <= p


def test_interleaved_smaller_bubble():
    for p, m, v in itertools.product((2, 3, 4, 8), (4, 8, 16), (2, 3)):
        if m % p:
            continue
        base = simulate(build_schedule("1f1b", p, m), 1, 2, 0)
        inter = simulate(build_schedule("interleaved-1f1b", p, m, v), 1 / v, 2 / v, 0)
        assert inter.step_time < base.step_time
        assert max(inter.bubble) < max(base.bubble)
        # Megatron's bubble: (p - 1) / v chunks' worth of F + B, over m micro-batches
        ideal = (p - 1) / v * 3 / (m * 3 + (p - 1) / v * 3)
        assert max(inter.bubble) == pytest.approx(ideal, abs=1e-9), (p, m, v)


def test_zb_h1_smaller_bubble_same_peak():
    for p, m in itertools.product((2, 3, 4, 8), (1, 2, 3, 4, 5, 8, 16, 32)):
        o = simulate(build_schedule("1f1b", p, m))
        z = simulate(build_schedule("zb-h1", p, m))
        bub_o, bub_z = o.step_time - 3 * m, z.step_time - 3 * m  # idle time of each rank
        assert bub_z < bub_o
        if m >= p:
            assert bub_z == pytest.approx(bub_o / 3)  # (p-1)(F+B-W) vs (p-1)(F+B+W)
        assert max(z.peak_activations) <= max(o.peak_activations)
        assert all(a <= p for a in z.peak_activations)


def test_schedule_is_data():
    s = build_schedule("1f1b", 2, 3)
    assert s.compute(0) == [Action("F", 0), Action("F", 1), Action("B", 0), Action("F", 2),
                            Action("B", 1), Action("B", 2)]
    assert s.compute(1) == [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1),
                            Action("F", 2), Action("B", 2)]
    # rank 1 posts the receive of F1's input before B0 runs, and sends B0's grad right after
    acts = list(s.actions[1])
    assert acts[:5] == [Action("RECV_F", 0), Action("F", 0), Action("RECV_F", 1), Action("B", 0),
                        Action("SEND_B", 0)]
    assert "rank 0: F(0,0) F(1,0) B(0,0)" in str(s)
    z = build_schedule("zb-h1", 4, 8)
    assert z.split_backward and all(any(a.kind == "W" for a in z.compute(r)) for r in range(4))
    f = forward_only_schedule(2, 3, 2)
    assert [a.kind for a in f.compute(0)] == ["F"] * 6
    assert simulate(f).deadlock == []


def test_deadlock_detected():
    # rank 1 waits for a gradient before running the forward that would produce it
    orders = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    acts = with_comms(orders, 2, 1)
    s = Schedule("broken", 2, 1, 1, False, acts)
    r = simulate(s)
    assert r.deadlock and "rank 0: B(0,0)" in r.deadlock[0]
    with pytest.raises(AssertionError, match="out of order"):
        validate(s)


def test_comm_latency_and_per_rank_times():
    s = build_schedule("1f1b", 4, 8)
    r0 = simulate(s, 1, 2, 0, t_comm=0.0)
    r1 = simulate(s, 1, 2, 0, t_comm=0.5)
    assert r1.step_time > r0.step_time
    slow = simulate(s, [1, 1, 2, 1], [2, 2, 4, 2], 0)
    assert slow.bubble[2] < min(slow.bubble[r] for r in (0, 1, 3))  # the slow rank idles least
    with pytest.raises(ValueError, match="one per rank"):
        simulate(s, [1, 2], 1, 1)


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="schedule='pipedream' is unknown"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="--micro-batches to be a multiple of pp=4"):
        build_schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="interleaved-1f1b with virtual_stages=1"):
        build_schedule("interleaved-1f1b", 2, 4, 1)
    assert build_schedule("interleaved-1f1b", 1, 3, 1).pp == 1  # no pipeline: nothing to interleave
    with pytest.raises(ValueError, match="needs schedule='interleaved-1f1b'"):
        build_schedule("zb-h1", 2, 4, 2)
    with pytest.raises(ValueError, match="micro_batches=0"):
        build_schedule("1f1b", 2, 0)


def test_split_layers():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(6, 2, layers_per_stage=[1, 5]) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages"):
        split_layers(3, 4)
    # (1 chunk per rank is no interleaving over pp > 1: not offered)
    with pytest.raises(ValueError, match=r"chunks: choose --virtual-stages in \[3\], or give"):
        split_layers(6, 2, 2)
    with pytest.raises(ValueError, match=r"chunks: no --virtual-stages >= 2 divides them: use "
                                         r"a layer count divisible by 4, or give"):
        split_layers(7, 2, 2)
    with pytest.raises(ValueError, match=r"choose --virtual-stages in \[1, 3\]"):
        split_layers(3, 1, 2)  # one rank: a single chunk is fine
    with pytest.raises(ValueError, match="sums to 5"):
        split_layers(6, 2, layers_per_stage=[2, 3])
    with pytest.raises(ValueError, match="give 2 positive counts"):
        split_layers(6, 2, layers_per_stage=[6])


def test_deferred_weight_grads_equal_plain_backward():
    """B (input grads, linears' dW deferred) then W (deferred GEMMs + other grads, accumulated
    on the leaves) equals one plain backward in float64, with or without saved-tensor hooks,
    and W fires every parameter's post-accumulate-grad hook."""
    import contextlib

    import torch
    from torch import nn

    from distllm.ops.weight_grad import DeferLinearWeightGrads, WeightGradStore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3, bias=False))
    model = model.double()
    x = torch.randn(2, 3, 7, dtype=torch.float64).transpose(0, 1)  # non-contiguous (3, 2, 7)
    gy = torch.randn(3, 2, 3, dtype=torch.float64)
    xr = x.detach().requires_grad_()
    torch.autograd.backward(model(xr), gy)
    ref = [p.grad.clone() for p in model.parameters()]
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    for hooks in (False, True):
        model.zero_grad(set_to_none=True)
        fired.clear()
        store, xi = WeightGradStore(), x.detach().requires_grad_()
        saved = (torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t)
                 if hooks else contextlib.nullcontext())
        with saved, DeferLinearWeightGrads(store):
            y = model(xi)
        params = list(model.parameters())
        grads = torch.autograd.grad(y, [xi] + params, gy, allow_unused=True)
        assert (grads[0] - xr.grad).abs().max() < 1e-12
        assert grads[1] is None and grads[2] is None and grads[5] is None  # deferred linears
        assert all(p.grad is None for p in params) and not fired
        store.params += [p for p, g in zip(params, grads[1:], strict=True) if g is not None]
        store.grads += [g for g in grads[1:] if g is not None]
        store.accumulate()
        for p, r in zip(params, ref, strict=True):
            assert (p.grad - r).abs().max() < 1e-12
        assert sorted(map(id, fired)) == sorted(map(id, params))


def test_deferred_weight_grads_leave_a_frozen_bias_alone():
    """A linear whose weight trains and whose bias is frozen (partial fine-tuning) defers its
    weight's gradient; W gives the bias none, and the weight's equals the plain backward's."""
    import torch
    from torch import nn

    from distllm.ops.weight_grad import DeferLinearWeightGrads, WeightGradStore

    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    lin.bias.requires_grad_(False)
    x, gy = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    torch.autograd.backward(lin(x), gy)
    ref, lin.weight.grad = lin.weight.grad, None
    store = WeightGradStore()
    with DeferLinearWeightGrads(store):
        y = lin(x)
    torch.autograd.grad(y, [lin.weight], gy, allow_unused=True)
    assert len(store.deferred) == 1 and store.deferred[0][0][1] is None  # (weight, None)
    store.accumulate()
    assert lin.bias.grad is None and (lin.weight.grad - ref).abs().max() < 1e-12

def test_deferred_weight_grads_take_linear_called_with_keywords():
    """``F.linear(input=x, weight=w, bias=b)``, every argument by keyword, defers as the
    positional call does: B gives dX alone, W the weight's and the bias's gradients."""
    import torch
    import torch.nn.functional as F

    from distllm.ops.weight_grad import DeferLinearWeightGrads, WeightGradStore

    torch.manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(5, 3, dtype=torch.float64)
    torch.autograd.backward(F.linear(x, w, b), gy)
    ref = [t.grad for t in (x, w, b)]
    x.grad = w.grad = b.grad = None
    store = WeightGradStore()
    with DeferLinearWeightGrads(store):
        y = F.linear(input=x, weight=w, bias=b)
    dx, dw, db = torch.autograd.grad(y, [x, w, b], gy, allow_unused=True)
    assert dw is None and db is None and len(store.deferred) == 1
    store.accumulate()
    assert (dx - ref[0]).abs().max() < 1e-12
    assert (w.grad - ref[1]).abs().max() < 1e-12 and (b.grad - ref[2]).abs().max() < 1e-12



def test_w_runs_one_layer_at_a_time_and_frees_each_as_it_goes():
    """W accumulates each deferred GEMM's result at once and drops its record, so that the
    tensors it kept (a layer's X and dY) are freed before the next layer's GEMM runs: the
    chunk's records and weight gradients are never all held together."""
    import weakref

    import torch

    from distllm.ops.weight_grad import WeightGradStore

    store = WeightGradStore()
    params = [torch.zeros(2, requires_grad=True) for _ in range(3)]
    kept = [torch.ones(2) for _ in range(3)]
    refs = [weakref.ref(t) for t in kept]
    alive = []
    for i in range(3):
        def grads(t=kept[i], i=i):
            alive.append([r() is not None for r in refs])
            return (t * (i + 1),)
        store.defer((params[i],), grads)
    del kept, grads
    store.accumulate()
    assert alive == [[True, True, True], [False, True, True], [False, False, True]]
    assert [q.grad.tolist() for q in params] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert not store.deferred
