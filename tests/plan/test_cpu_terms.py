"""The CPU profile's step terms: the attention core at its measured fused-kernel efficiency,
GeLU per element, ranks sharing cores, every rank's optimizer step on those cores, the
step's scalar all-reduces, and gloo's ring-only all-reduce; and the calibration that
measures them."""

from __future__ import annotations

import dataclasses

import pytest

from distllm.plan import CostModel, Layout, load_profile, preset
from distllm.plan.collectives import collective_time
from distllm.plan.hardware import Link, Profile
from distllm.plan.runtime import runtime

CPU = load_profile("cpu")
DP4 = Layout(1, 1, 4, 0, "none", 1, "none", False, 1)


def _cm(prof: Profile = CPU, ranks_per_host: int = 4, vocab: int = 256, **kw) -> CostModel:
    shape = preset("tiny").with_(global_batch=16, seq_len=128, vocab=vocab)
    return CostModel(shape, prof, 4, 4, dtype="float32", ranks_per_host=ranks_per_host, **kw)


def test_gelu_per_element_replaces_its_bytes():
    g = (3e-9, 5e-9)
    base = _cm(dataclasses.replace(CPU, gelu_s_per_element=(0.0, 0.0)))
    timed = _cm(dataclasses.replace(CPU, gelu_s_per_element=g))
    a, b = base.layer_times(4, DP4), timed.layer_times(4, DP4)
    inner = 4 * 128 * 512  # tokens x ffn of one block
    gelu_bytes = 2 * 4 * inner / (CPU.memory_bandwidth * CPU.memory_efficiency)
    assert b["fwd"] - a["fwd"] == pytest.approx(g[0] * inner - gelu_bytes, rel=1e-9)
    assert b["bwd"] - a["bwd"] == pytest.approx(g[1] * inner - 2 * gelu_bytes, rel=1e-9)


def test_attention_core_at_the_fused_kernels_efficiency():
    slow = _cm(dataclasses.replace(CPU, flash_efficiency=0.1)).layer_times(4, DP4)
    fast = _cm(dataclasses.replace(CPU, flash_efficiency=0.4)).layer_times(4, DP4)
    assert slow["attention"] == pytest.approx(4 * fast["attention"], rel=1e-9)


def test_gloo_links_run_the_ring_at_every_size():
    ring = Link(1e9, 1e-3, tree=False)
    nccl = dataclasses.replace(ring, tree=True)
    assert collective_time("all_reduce", 8, 4, ring) == pytest.approx(6e-3, rel=1e-3)
    assert collective_time("all_reduce", 8, 4, nccl) == pytest.approx(4e-3, rel=1e-3)


@pytest.mark.parametrize("zero,dp,count", [(0, 4, 1), (2, 4, 1), (3, 4, 1), (1, 1, 3)])
def test_the_steps_scalar_all_reduces(zero, dp, count):
    """One world all-reduce carries the norm's squares and the loss (and ZeRO's inf/NaN flag
    over more than one DP rank); a lone ZeRO rank reduces the norm over TP x PP, the flag
    and the loss over the world."""
    lay = Layout(4 // dp, 1, dp, zero, "none", 1, "none", False, 1)
    one = collective_time("all_reduce", 8, 4, CPU.link(False))
    want = one if count == 1 else 3 * one  # the model group is the world here (tp4)
    assert _cm().sync_time(lay) == pytest.approx(want, rel=1e-9)
    # tp2 x dp2 with DDP: the one all-reduce is the world's
    tp2 = Layout(2, 1, 2, 0, "none", 1, "none", False, 1)
    assert _cm().sync_time(tp2) == pytest.approx(one, rel=1e-9)
    # bf16 at ZeRO-0 runs ZeroOptimizer's checks one by one: the norm over the TP pair
    bf16 = CostModel(preset("tiny").with_(global_batch=16, seq_len=128), CPU, 4, 4,
                     dtype="bfloat16", ranks_per_host=4)
    two = collective_time("all_reduce", 8, 2, CPU.link(False))
    assert bf16.sync_time(tp2) == pytest.approx(2 * one + two, rel=1e-9)
    meg = _cm(runtime_name=dataclasses.replace(runtime("distllm"), step_syncs=False))
    assert meg.sync_time(lay) == 0.0
    assert _cm().evaluate(lay).time["sync"] == _cm().sync_time(lay)


def test_oversubscribed_ranks_share_the_cores_at_the_measured_cost():
    """4 ranks on 2 cores: the compute of all of them, times the sharing factor, over the
    cores; each rank's optimizer step runs on the shared cores too."""
    quiet = dataclasses.replace(CPU, core_sharing=1.0, step_overhead_s=0.0)
    loud = dataclasses.replace(quiet, core_sharing=1.5)
    a, b = _cm(quiet), _cm(loud)
    tf, tb, _, _ = a.rank_times(DP4)
    work = 4 * (tf[0] + tb[0])  # one stage, 4 ranks, uses_cpu link: comm inside the work
    assert b.step_time(DP4)[0] - a.step_time(DP4)[0] == pytest.approx(
        0.5 * work / 2 + 0.5 * 2 * a.step_time(DP4)[1]["optimizer"], rel=1e-6)
    # as many ranks as cores: no sharing factor, the optimizer step counted once
    c, d = _cm(quiet, ranks_per_host=2), _cm(loud, ranks_per_host=2)
    assert c.step_time(DP4)[0] == pytest.approx(d.step_time(DP4)[0], rel=1e-12)


def test_profile_json_keeps_the_new_fields():
    prof = dataclasses.replace(CPU, gelu_s_per_element=(1e-9, 2e-9), core_sharing=1.2,
                               links={k: dataclasses.replace(v, tree=False, cpu_latency=1e-4,
                                                             cpu_per_byte=2e-10)
                                      for k, v in CPU.links.items()})
    back = Profile.from_json(prof.to_json())
    assert back == prof


def test_calibration_measures_attention_and_gelu():
    from distllm.plan.calibrate import measure_attention, measure_gelu

    att = measure_attention(50e9, (1, 2, 32, 16))
    assert 0 < att["efficiency"] <= 1 and att["ms"] > 0
    fwd, bwd = measure_gelu((64, 16, 64))
    assert 0 < fwd < 1e-6 and 0 < bwd < 1e-6


def test_cross_entropy_all_reduces_under_tp():
    """The vocab-parallel loss all-reduces the per-token max, then the per-token sum and
    target logit (fp32), once per micro-batch forward."""
    tp2 = Layout(2, 1, 2, 0, "none", 1, "none", False, 1)
    cm = _cm(vocab=8192)  # split: more than twice the hidden size (128)
    tokens = 8 * 128
    link = CPU.link(False)
    ce = collective_time("all_reduce", 4 * tokens, 2, link) + collective_time(
        "all_reduce", 8 * tokens, 2, link)
    *_, emb_c, head_c = cm._ends(8, tp2)
    assert head_c - emb_c == pytest.approx(ce, rel=1e-9)
    assert cm._ends(4, DP4)[-2:] == (0.0, 0.0)


def test_a_small_vocabulary_held_whole_costs_no_collective():
    """distllm holds a small vocabulary whole under TP (the model's own rule, here at tp=2
    a vocabulary of at most twice the hidden size): no embedding, cross-entropy or head
    collective, and every TP rank holds and computes the whole head."""
    tp2 = Layout(2, 1, 2, 0, "none", 1, "none", False, 1)
    big, small = _cm(vocab=8192), _cm(vocab=256)  # hidden 128: 256 is held whole
    assert small.shape.splits_vocab(2) is False and big.shape.splits_vocab(2) is True
    *_, head_w, emb_c, head_c = small._ends(8, tp2)
    assert (emb_c, head_c) == (0.0, 0.0)
    assert small._ends(8, Layout(1, 1, 4, 0, "none", 1, "none", False, 1))[4] == head_w
    assert small.shape.vocab_rows(2) == 256 and big.shape.vocab_rows(2) == 8192 // 2
    # sequence parallelism keeps the split
    assert small.shape.splits_vocab(2, sequence_parallel=True) is True


def test_a_lockstep_collective_counts_once_on_shared_cores():
    """Link times are measured with every rank in the collective at once, so on shared
    cores a TP collective adds its time to the step once, not once per rank."""
    quiet = dataclasses.replace(CPU, core_sharing=1.0, step_overhead_s=0.0)
    tp4 = Layout(4, 1, 1, 0, "none", 1, "none", False, 1)
    cm = _cm(quiet)
    tf, tb, _, tc = cm.rank_times(tp4)
    step, parts = cm.step_time(tp4)
    tail = parts["optimizer"] * 2 + parts["dp_comm"] + parts["zero_comm"]
    assert step == pytest.approx(4 * (tf[0] + tb[0] - tc[0]) / 2 + tc[0] + tail + parts["sync"],
                                 rel=1e-9)


# ---------------------------------------------------------------- gloo's CPU ------------
def _with_gloo_cpu(latency: float, per_byte: float) -> Profile:
    return dataclasses.replace(CPU, core_sharing=1.0, step_overhead_s=0.0, links={
        k: dataclasses.replace(v, cpu_latency=latency, cpu_per_byte=per_byte)
        for k, v in CPU.links.items()})


GLOO, NO_GLOO_CPU = _with_gloo_cpu(2e-4, 4e-10), _with_gloo_cpu(0.0, 0.0)


def test_collective_cpu_is_a_ring_in_cpu_seconds():
    from distllm.plan.comm_cpu import collective_cpu

    link = GLOO.link(False)
    s = 8 << 20
    assert collective_cpu("all_reduce", s, 4, link) == pytest.approx(
        6 * 2e-4 + 6 / 4 * s * 4e-10, rel=1e-12)
    assert collective_cpu("all_gather", s, 4, link) == pytest.approx(
        3 * 2e-4 + 3 / 4 * s * 4e-10, rel=1e-12)
    assert collective_cpu("p2p", s, 2, link) == pytest.approx(2e-4 + s * 4e-10, rel=1e-12)
    # the same bytes in 3 buckets: 2 more rings' worth of steps
    assert collective_cpu("all_reduce", s, 4, link, calls=3) == pytest.approx(
        collective_cpu("all_reduce", s, 4, link) + 2 * 6 * 2e-4, rel=1e-12)
    assert collective_cpu("all_reduce", s, 1, link) == 0.0
    assert collective_cpu("all_reduce", s, 4, NO_GLOO_CPU.link(False)) == 0.0  # not measured


def test_background_collectives_take_cpu_from_the_compute():
    """dp4 on shared cores: the gradient all-reduce's CPU (all 4 ranks) over the cores is
    added to the CPU-bound step; the ranks' CPU seconds count it too."""
    from distllm.plan.comm_cpu import collective_cpu, rank_collective_cpu

    a, b = _cm(NO_GLOO_CPU), _cm(GLOO)
    coll = rank_collective_cpu(b, DP4)
    n = b.rank_params(DP4)[0][0]
    ar = collective_cpu("all_reduce", 4 * n, 4, GLOO.link(False))
    assert coll == [(0.0, pytest.approx(ar, rel=1e-12))]
    (sa, pa), (sb, pb) = a.step_time(DP4), b.step_time(DP4)
    assert sb - sa == pytest.approx(4 * ar / 2, rel=1e-9)
    assert pb["cpu_busy"] - pa["cpu_busy"] == pytest.approx(4 * ar, rel=1e-9)


def test_zero3_and_pipeline_collectives_are_counted_per_unit_and_message():
    from distllm.plan.comm_cpu import collective_cpu, rank_collective_cpu

    cm, link = _cm(GLOO), GLOO.link(False)
    z3 = Layout(1, 1, 4, 3, "none", 1, "none", False, 1)
    blocks_n = cm.rank_params(z3)
    unit, rest = blocks_n[1], blocks_n[0][0] - 4 * blocks_n[1]
    want = sum(k * (2 * collective_cpu("all_gather", 4 * n, 4, link)
                    + collective_cpu("reduce_scatter", 4 * n, 4, link))
               for k, n in ((4, unit), (1, rest)))
    # the head, the forward's last unit, stays gathered for the backward that starts with it
    want -= collective_cpu("all_gather", 4 * cm.end_params(z3)[1], 4, link)
    assert rank_collective_cpu(cm, z3)[0][1] == pytest.approx(want, rel=1e-12)
    # pp2 x dp2, 4 micro-batches of 2 sequences: each stage receives or sends a (2, 128, 128)
    # fp32 activation and its gradient per micro-batch (2 messages each), plus its DP
    # all-reduce
    pp2 = Layout(1, 2, 2, 0, "1f1b", 4, "none", False, 1)
    msg = collective_cpu("p2p", 4 * 2 * 128 * 128, 2, link)
    for r, (lock, bg) in enumerate(rank_collective_cpu(cm, pp2)):
        n = cm.rank_params(pp2)[0][r]
        assert lock == 0.0
        assert bg == pytest.approx(4 * 2 * msg + collective_cpu("all_reduce", 4 * n, 2, link),
                                   rel=1e-12)


def test_tp_collectives_cpu_is_lockstep_and_not_added_to_the_step():
    """A TP all-reduce's link time was measured with its CPU in it: its CPU counts in the
    ranks' CPU seconds, not again in the step."""
    from distllm.plan.comm_cpu import collective_cpu, rank_collective_cpu

    tp4 = Layout(4, 1, 1, 0, "none", 1, "none", False, 1)
    a, b = _cm(NO_GLOO_CPU), _cm(GLOO)
    link, tokens = GLOO.link(False), 16 * 128
    one = collective_cpu("all_reduce", 4 * tokens * 128, 4, link)
    ce = sum(collective_cpu("all_reduce", k * 4 * tokens, 4, link) for k in (1, 2))
    # 4 blocks x 4, the embedding's forward (none in its backward), the head's input
    # gradient + loss
    assert rank_collective_cpu(b, tp4) == [(pytest.approx(18 * one + ce, rel=1e-12), 0.0)]
    assert b.step_time(tp4)[0] == pytest.approx(a.step_time(tp4)[0], rel=1e-12)
    # the ranks' CPU seconds: gloo's CPU of the 4 ranks instead of the cores held for the
    # link time
    wire = a.rank_times(tp4)[3][0]
    assert b.step_time(tp4)[1]["cpu_busy"] - a.step_time(tp4)[1]["cpu_busy"] == pytest.approx(
        4 * (18 * one + ce) - 2 * wire, rel=1e-9)


def test_calibration_measures_the_links_cpu():
    """The loopback link's fit carries gloo's CPU seconds per ring step and per byte, from
    the ranks' own CPU time. The smaller half of the sizes is latency-bound (1 and 4 KiB),
    so that the intercept is gloo's per-step CPU, not the difference of two bandwidth-bound
    points (a 256 KiB point that stays in cache while 2 MiB does not fits an intercept of 0);
    the per-byte term is above a picosecond, a measured slope, not the fit's floor."""
    from distllm.plan.calibrate import measure_link

    link, why = measure_link(None, nranks=2, reps=5, sizes=(1 << 10, 4 << 10, 1 << 20))
    assert why == ""
    assert link.cpu_latency > 0 and link.cpu_per_byte > 1e-12
    assert "CPU seconds per rank" in link.source  # the measured points, for the record


def test_calibration_fits_the_ranks_cpu_not_the_wall_time(monkeypatch):
    """The CPU terms are the ring fit of the ranks' CPU seconds (median over ranks), the
    wall terms that of the slowest rank's time: fed known points, each fit comes out."""
    from distllm.plan import calibrate as cal

    sizes = (4 << 10, 1 << 20, 8 << 20)
    wall = {s: 1e-3 + s * 2e-9 for s in sizes}
    cpu = {s: 3e-4 + s * 5e-10 for s in sizes}
    per_rank = [{s: (wall[s] * f, cpu[s] * g) for s in sizes}
                for f, g in ((1.0, 0.5), (0.9, 1.0), (0.8, 2.0), (0.7, 1.0))]
    monkeypatch.setattr("distllm.testing.run_distributed", lambda *a, **k: per_rank)
    link, _ = cal.measure_link(None, nranks=4, sizes=sizes)
    a, b = cal.fit_alpha_beta(wall, 4)
    ca, cb = cal.fit_alpha_beta(cpu, 4)
    assert (link.latency, 1 / link.bandwidth) == pytest.approx((a, b), rel=1e-9)
    assert (link.cpu_latency, link.cpu_per_byte) == pytest.approx((ca, cb), rel=1e-9)
