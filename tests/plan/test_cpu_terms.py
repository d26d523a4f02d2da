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


def _cm(prof: Profile = CPU, ranks_per_host: int = 4, **kw) -> CostModel:
    shape = preset("tiny").with_(global_batch=16, seq_len=128)
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


@pytest.mark.parametrize("zero,count", [(0, 1), (2, 3), (3, 3)])
def test_the_steps_scalar_all_reduces(zero, count):
    lay = Layout(1, 1, 4, zero, "none", 1, "none", False, 1)
    one = collective_time("all_reduce", 8, 4, CPU.link(False))
    assert _cm().sync_time(lay) == pytest.approx(count * one, rel=1e-9)
    # tp2 x dp2 without ZeRO: the norm over the TP pair, the loss over all four
    tp2 = Layout(2, 1, 2, 0, "none", 1, "none", False, 1)
    two = collective_time("all_reduce", 8, 2, CPU.link(False))
    assert _cm().sync_time(tp2) == pytest.approx(one + two, rel=1e-9)
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
                               links={k: dataclasses.replace(v, tree=False)
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
    cm = _cm()
    tokens = 8 * 128
    link = CPU.link(False)
    ce = collective_time("all_reduce", 4 * tokens, 2, link) + collective_time(
        "all_reduce", 8 * tokens, 2, link)
    *_, emb_c, head_c = cm._ends(8, tp2)
    assert head_c - emb_c == pytest.approx(ce, rel=1e-9)
    assert cm._ends(4, DP4)[-2:] == (0.0, 0.0)


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
