"""The one timing module: interleaved order, samples and their summary, a failing variant
dropped on request, and across 2 gloo ranks the max over ranks and a collective timed alone."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from distllm.diagnostics import timing
from distllm.testing import run_distributed
from tests._collectives import counted_all_reduces


def test_interleaved_order_and_samples():
    calls = []
    samples = timing.interleaved_samples(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, reps=4)
    # warm-up a b, then a b | b a | a b | b a
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(samples) == {"a", "b"} and all(len(s) == 4 for s in samples.values())
    st = timing.interleaved({"a": lambda: None}, warmup=0, reps=4)["a"]
    assert st.n == 4 and st.p10_ms <= st.median_ms <= st.p90_ms and st.min_ms <= st.p10_ms


def test_stats_of_quantiles():
    st = timing.stats_of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (st.median_ms, st.p10_ms, st.p90_ms, st.min_ms, st.n) == (3.0, 1.4, 4.6, 1.0, 5)
    assert st.spread == pytest.approx((4.6 - 1.4) / 6)
    assert timing.stats_of([2.0]).p90_ms == 2.0
    with pytest.raises(ValueError, match="no samples"):
        timing.stats_of([])


def test_paired_band_takes_each_round_alone():
    """A figure of several variants, round by round: a drift of the machine that moves every
    variant of a round alike leaves it steady, where each variant's own band is as wide as
    the drift."""
    drift = [1.0, 1.3, 0.9, 1.2, 0.8, 1.1]
    a, b = [11 * d for d in drift], [10 * d for d in drift]
    assert timing.paired_band(lambda x, y: x / y, a, b) == pytest.approx((1.1, 1.1))
    flipped = timing.paired_band(lambda x, y: x / y, a, b[::-1])
    assert flipped[0] < 0.95 and flipped[1] > 1.3, flipped
    # three series; rounds where the figure is undefined are left out
    c = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    lo, hi = timing.paired_band(lambda x, y, z: (x - y) / z if z else None, a, b, c)
    # the five rounds left: 1.0, 1.3, 1.2, 0.8, 1.1 (the drift); p10 0.88, p90 1.26
    assert (lo, hi) == pytest.approx((0.88, 1.26)), (lo, hi)
    # unequal lengths (a dropped variant) or too few rounds: no band
    assert timing.paired_band(lambda x, y: x / y, a, b[:-1]) is None
    short = timing.PAIRED_MIN - 1
    assert timing.paired_band(lambda x, y: x / y, a[:short], b[:short]) is None
    assert timing.paired_band(lambda x, y, z: (x - y) / z if z else None,
                              a[:-1], b[:-1], [0.0] + c[1:-1]) is None  # 4 rounds left


def test_timers_and_before_each():
    fake = iter([5.0, 7.0, 6.0])
    before = []
    samples = timing.interleaved_samples({"x": lambda: None}, warmup=0, reps=3,
                                         timer=lambda fn: next(fake),
                                         before_each=lambda: before.append(1))
    assert samples == {"x": [5.0, 7.0, 6.0]} and len(before) == 3
    synced = []
    ms = timing.wall_timer(lambda: (time.sleep(0.02), synced.append(1)))(lambda: None)
    assert ms >= 20.0 and synced == [1]  # the sync is inside the timed region
    busy = timing.process_time_timer(lambda: sum(range(200_000)))
    idle = timing.process_time_timer(lambda: time.sleep(0.05))
    assert busy > 0 and idle < 25.0  # CPU time: a sleep costs (almost) none


def test_a_failing_variant_is_dropped_when_asked():
    calls = {"ok": 0, "bad": 0}

    def bad():
        calls["bad"] += 1
        raise RuntimeError("no kernel for this shape\nsecond line")

    errors: dict[str, str] = {}
    samples = timing.interleaved_samples(
        {"ok": lambda: calls.__setitem__("ok", calls["ok"] + 1), "bad": bad}, warmup=1,
        reps=3, errors=errors)
    assert list(samples) == ["ok"] and len(samples["ok"]) == 3 and calls == {"ok": 4, "bad": 1}
    assert errors == {"bad": "RuntimeError: no kernel for this shape"}
    with pytest.raises(RuntimeError, match="no kernel"):
        timing.interleaved_samples({"bad": bad}, warmup=0, reps=1)


def test_single_process_max_over_ranks_is_the_identity():
    assert timing.max_over_ranks([1.5, 2]) == [1.5, 2.0]


def _ranks() -> dict:
    rank = dist.get_rank()
    out = {"max": timing.max_over_ranks([float(rank), 10.0 - rank])}
    slow = timing.max_over_ranks_timer(lambda fn: 3.0 if rank == 1 else 1.0)
    out["timer"] = slow(lambda: None)
    with counted_all_reduces() as ran:
        out["ar"] = timing.time_collective("all_reduce", 1 << 16, reps=3)
    out["ar_ran"] = ran
    out["ag"] = timing.time_collective("all_gather", 1001, reps=2, warmup=0)
    out["rs"] = timing.time_collective("reduce_scatter", 1001, reps=2)  # gloo: all-reduce
    try:
        timing.time_collective("broadcast", 4)
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


def test_across_ranks_the_slowest_rank_counts():
    res = run_distributed(_ranks, 2, timeout=120)
    for r in res:  # both ranks get the same answers
        assert r["max"] == [1.0, 10.0] and r["timer"] == 3.0
        assert len(r["ar"]) == 3 and all(t > 0 for t in r["ar"])
        assert len(r["ag"]) == len(r["rs"]) == 2 and "op='broadcast'" in r["bad"]
    assert res[0]["ar"] == res[1]["ar"]  # each repetition is the max over the two ranks
    # what is timed is the all-reduce the layers run (on 2 gloo ranks, one exchange): the
    # warm-up and 3 repetitions, then the MAX of the 3 timings over the ranks
    assert res[0]["ar_ran"] == [("exchange", 1 << 16)] * 4 + [("exchange", 3)]


def test_collective_timings_sit_on_the_groups_device(monkeypatch):
    """NCCL takes CUDA tensors only: the timings' all-reduce goes to the group's device."""
    seen, real_tensor = [], torch.tensor
    monkeypatch.setattr(timing.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(timing.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(timing.dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(timing.torch, "tensor", lambda v, dtype, device: seen.append(device)
                        or real_tensor(v, dtype=dtype))
    # NCCL: distllm's all-reduce hands the tensor to the backend's own
    monkeypatch.setattr(timing.dist, "all_reduce", lambda t, op, group, async_op: None)
    assert timing.max_over_ranks([1.0]) == [1.0]
    assert seen == [torch.device("cuda", 3)]
    timing.max_over_ranks([1.0], device="cpu")
    assert seen[-1] == torch.device("cpu")


def test_device_sync_waits_for_that_gpu(monkeypatch):
    # a bare synchronize() waits for the current device (cuda:0 where a rank never set its
    # own): the timers would measure launches, not kernels
    from distllm.diagnostics.timing import device_sync

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    device_sync(torch.device("cuda", 1))()
    assert synced == [torch.device("cuda", 1)]
    assert device_sync(torch.device("cpu")) is None
