"""The search's ranking is by one time model (the pipeline simulator's, where it runs) for the
rows it shows, so more memory never makes the pick slower; the links that pipeline and DP
transfers cross; the pipeline depth the trainer accepts."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from distllm.parallel.mesh import mesh_groups
from distllm.plan import load_profile, preset, search
from distllm.plan.bubble import SCHEDULES, pipeline_lower_bound, pipeline_time, simulator_or_none
from distllm.plan.cost import CostModel
from distllm.plan.layout import Layout

GiB = 2**30
SIM = simulator_or_none()  # distllm.parallel.pipeline's replay: always here (asserted below)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_lower_bound_bounds_the_simulator_and_the_closed_form(schedule):
    """The search skips the simulator for a layout only when this bound says it cannot win:
    it must never exceed what the simulator (or, where it refuses a case, the closed form)
    gives, with uneven ranks and transfers."""
    assert SIM is not None, "the pipeline simulator (distllm.parallel.pipeline) did not import"
    rng = random.Random(7)
    for _ in range(60):
        p, m = rng.choice((2, 3, 4, 6)), rng.choice((1, 2, 4, 6, 8, 12))
        v = rng.choice((2, 3)) if schedule == "interleaved-1f1b" else 1
        if schedule == "interleaved-1f1b":
            m = p * rng.choice((1, 2, 3))
        elif schedule != "gpipe":
            m = max(m, p)
        tf = [rng.uniform(0.5, 2.0) for _ in range(p)]
        tb = [f * rng.uniform(1.5, 2.5) for f in tf]
        tw = [b * rng.uniform(0.2, 0.5) for b in tb] if schedule == "zb-h1" else [0.0] * p
        c = rng.choice((0.0, 0.01, 0.3))
        low = pipeline_lower_bound(schedule, p, m, v, tf, tb, c)
        sim = pipeline_time(schedule, p, m, v, tf, tb, tw, c, SIM)
        closed = pipeline_time(schedule, p, m, v, tf, tb, tw, c)
        assert low <= sim * (1 + 1e-12) and low <= closed * (1 + 1e-12), (p, m, v, c)
        assert low >= m * max(f + b for f, b in zip(tf, tb, strict=True)) * (1 - 1e-12)


def test_the_rows_shown_are_the_fastest_by_the_simulator():
    """llama2-7b on 32 H100s: by the closed form, interleaved v7 ranks below the first 8
    (which the search used to re-time alone), yet the simulator puts it first. The first
    ``exact`` rows must be the simulator's first five of every layout that fits, in order."""
    shape, prof = preset("llama2-7b"), load_profile("h100")
    pins = {"zero": 2, "checkpointing": "none", "micro_batches": 32}
    res = search(shape, 32, None, "h100", pins=pins, keep_rejected=False, exact=5)
    cm = CostModel(shape, prof, 32, 8, dtype="bfloat16", simulator=SIM)
    every = sorted((cm.evaluate(e.layout) for e in res.ranked),
                   key=lambda e: (e.step_time_s, e.memory["total"]))
    assert [e.layout for e in res.ranked[:5]] == [e.layout for e in every[:5]]
    assert [e.step_time_s for e in res.ranked[:5]] == [e.step_time_s for e in every[:5]]
    assert res.exact == 5 and res.simulated >= 5
    times = [e.step_time_s for e in res.ranked]
    assert times == sorted(times)


def test_a_layout_the_simulator_declines_is_not_called_simulator_ranked(monkeypatch):
    """The simulator declines a case of more than SIM_MAX_ACTIONS actions, and that layout
    keeps the closed form's time. gpt2-xl at pp8 with 4096 sequences: the search said its
    first 2 rows were "ranked by the pipeline simulator" while the runner-up (v2.m1024,
    16384 actions) carried the closed form, and layouts it declined, which it could not rank,
    beat the pick when simulated. The rows are now called simulator-ranked only while no
    declined layout's lower bound is below them, and the declined ones are counted."""
    from distllm.plan import bubble

    shape = preset("gpt2-xl").with_(global_batch=4096)
    pins = {"pp": 8, "tp": 1, "schedule": "interleaved-1f1b"}
    res = search(shape, 8, None, "a100-80gb", pins=pins, keep_rejected=False, exact=2)
    assert res.declined > 0 and res.exact == 0
    # with room for every case, nothing is declined and the first 2 are the simulator's
    monkeypatch.setattr(bubble, "SIM_MAX_ACTIONS", 10**6)
    full = search(shape, 8, None, "a100-80gb", pins=pins, keep_rejected=False, exact=2)
    assert full.declined == 0 and full.exact == 2
    assert full.best.step_time_s < res.best.step_time_s  # a declined layout was faster


def test_more_memory_never_makes_the_pick_slower():
    """llama2-7b on 64 H100s: at 35 GiB the pick took 5.597 s and at 40 GiB 5.607 s, the
    closed form having ranked a layout that fits only at 40 GiB above the faster one."""
    base = load_profile("h100")
    best = []
    for gib in (35, 40):
        prof = dataclasses.replace(base, memory_bytes=gib * GiB)
        best.append(search(preset("llama2-7b"), 64, None, prof, keep_rejected=False).best)
    assert best[1].step_time_s <= best[0].step_time_s


def _crosses_by_mesh(world: int, gpn: int, tp: int, pp: int, dp: int, group: str) -> bool:
    """Whether any group of this kind has ranks on two nodes, from the trainer's own rank
    layout (:func:`distllm.parallel.mesh.mesh_groups`): pipeline neighbours, or DP groups."""
    groups = mesh_groups(world, tp, pp, dp)[group]
    if group == "pp":
        return any(a // gpn != b // gpn for g in groups for a, b in itertools.pairwise(g))
    return any(len({r // gpn for r in g}) > 1 for g in groups)


@pytest.mark.parametrize(
    "world,tp,pp,dp",
    [(32, 1, 8, 4), (32, 1, 4, 8), (32, 2, 8, 2), (24, 1, 8, 3), (24, 2, 4, 3), (16, 2, 2, 4),
     (8, 1, 8, 1), (8, 2, 2, 2), (48, 1, 16, 3), (48, 2, 2, 12)],
)
def test_pipeline_and_dp_links_follow_the_rank_layout(world, tp, pp, dp):
    """tp1.pp8.dp4 on 4 nodes of 8: every other stage boundary crosses a node, so its
    transfers go over the inter-node link (they were charged at NVLink speed); tp1.pp8.dp3
    on 3 nodes: DP groups of stages 2 and 5 straddle two nodes."""
    shape = preset("gpt2-small").with_(global_batch=48)
    prof = load_profile("a100-80gb")
    cm = CostModel(shape, prof, world, 8, dtype="bfloat16")
    lay = Layout(tp, pp, dp, 1, "1f1b", 16)
    for group in ("pp", "dp"):
        want = _crosses_by_mesh(world, 8, tp, pp, dp, group)
        assert cm._link(group, lay) is prof.links["inter" if want else "intra"], group


def test_the_pipeline_takes_as_many_chunks_as_the_trainer():
    """The trainer cuts [embedding, blocks, head] into pp*v chunks
    (``distllm.train.config.check_layout``): tiny (4 blocks) runs pp=6, and interleaved v3
    over pp=2; pp=8 is refused with the trainer's count."""
    tiny = preset("tiny").with_(global_batch=36)
    res = search(tiny, 6, 6, "cpu", pins={"pp": 6, "schedule": "1f1b", "micro_batches": 6})
    assert res.ranked
    res = search(tiny, 2, 2, "cpu", pins={"pp": 2, "schedule": "interleaved-1f1b",
                                          "micro_batches": 2})
    assert {e.layout.virtual_stages for e in res.ranked} == {2, 3}
    res = search(tiny, 8, 8, "cpu", pins={"pp": 8})
    assert not res.ranked
    assert {e.rejected_reason for e in res.rejected} == {
        "pp=8 is more stages than the model's 6 pipeline layers (embedding, 4 blocks, head)"}
    res = search(tiny, 4, 4, "cpu", pins={"pp": 4, "schedule": "interleaved-1f1b"})
    assert {e.rejected_reason for e in res.rejected if e.layout.schedule != "none"} >= {
        "interleaving needs pp*v = 8 pipeline chunks, more than the model's 6 pipeline layers "
        "(embedding, 4 blocks, head)"}


def test_the_trainer_accepts_what_the_planner_offers_at_full_depth():
    """The planner's deepest tiny layouts pass the trainer's own check."""
    from distllm.train.config import ParallelConfig, TrainConfig, check_layout

    for pp, sch, v, m in ((6, "1f1b", 1, 6), (2, "interleaved-1f1b", 3, 2)):
        cfg = TrainConfig(model="tiny", global_batch=36 if pp == 6 else 32,
                          parallel=ParallelConfig(pp=pp, schedule=sch, virtual_stages=v,
                                                  micro_batches=m))
        check_layout(cfg, pp, n_layers=4, n_heads=preset("tiny").heads,
                     hidden=preset("tiny").hidden, seq_len=preset("tiny").seq_len)
