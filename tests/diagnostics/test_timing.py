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



class _FakeStream:
    """A CUDA stream on a virtual clock (ms) that the host's work advances: work queued
    starts when the work queued before it ends, and no earlier than it was queued; an event
    fires when what precedes it ends. The timer reads the same clock (``perf_counter``), so
    the test is exact, whatever the load of the machine."""

    def __init__(self, cycles_per_ms: float = 2e6):
        self.clock, self.free_at, self.cycles_per_ms, self.log = 0.0, 0.0, cycles_per_ms, []

    def perf_counter(self) -> float:  # time.perf_counter, in seconds
        return self.clock / 1e3

    def host(self, ms: float) -> None:  # the host spends ms (dispatching, waiting)
        self.clock += ms

    def run(self, ms: float) -> None:
        self.free_at = max(self.clock, self.free_at) + ms

    def sleep(self, cycles: int) -> None:  # torch.cuda._sleep
        self.log.append("busy-wait")
        self.run(cycles / self.cycles_per_ms)

    def event(self, enable_timing: bool = False) -> _FakeEvent:  # torch.cuda.Event
        return _FakeEvent(self)


class _FakeEvent:
    def __init__(self, stream: _FakeStream):
        self.stream, self.at = stream, None

    def record(self) -> None:
        self.stream.log.append("record")
        self.at = max(self.stream.clock, self.stream.free_at)

    def synchronize(self) -> None:
        self.stream.log.append("synchronize")
        self.stream.clock = max(self.stream.clock, self.at)

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at


def _fake_cuda(monkeypatch, sleep: bool = True) -> _FakeStream:
    import types
    from collections import deque

    s = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", s.event)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if sleep:
        monkeypatch.setattr(torch.cuda, "_sleep", s.sleep, raising=False)
    else:
        monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=s.perf_counter))
    # the timer's state starts empty (raising=False: a timer that keeps none still runs)
    monkeypatch.setattr(timing, "_dispatch_ms", deque(maxlen=16), raising=False)
    monkeypatch.setattr(timing, "_cycles_per_ms", {}, raising=False)
    monkeypatch.setattr(timing, "BUSY_WAIT_MS", (1.0, 20.0), raising=False)
    return s


def _step(s: _FakeStream, busy: list[bool], dispatch_ms: float = 3.0):
    """``dispatch_ms`` of host dispatch (Python), then a 2 ms kernel."""

    def fn():
        s.host(dispatch_ms)
        busy.append(s.free_at > s.clock)  # is the stream still busy when the kernel is queued?
        s.run(2.0)
        s.log.append("fn")

    return fn


def test_cuda_event_timer_keeps_the_hosts_dispatch_out(monkeypatch):
    """After a synchronisation the GPU idles: a start event recorded then fires at once, and
    the 3 ms the host takes to queue the 2 ms kernel were timed with it (5 ms). A busy-wait
    queued before the start event keeps the stream busy while the host dispatches."""
    s, busy = _fake_cuda(monkeypatch), []
    fn = _step(s, busy)
    assert [timing.cuda_event_timer(fn) for _ in range(4)] == pytest.approx([2.0] * 4)
    assert busy == [True] * 4  # every call dispatched while the stream was busy
    # the calibration (once), then per call: busy-wait, start, the call, end, wait for it
    per_call = ["busy-wait", "record", "fn", "record", "synchronize"]
    assert s.log == ["busy-wait", "record", "busy-wait", "record", "synchronize",
                     *per_call * 4]
    assert timing._cycles_per_ms[0] == pytest.approx(2e6)
    # the wait follows the host's dispatch: twice the longest of the latest calls, within
    # the bounds; none known yet: the longest
    assert timing._busy_wait_ms() == pytest.approx(6.0)
    timing.cuda_event_timer(_step(s, [], dispatch_ms=8.0))
    assert timing._busy_wait_ms() == pytest.approx(16.0)
    timing.cuda_event_timer(_step(s, [], dispatch_ms=0.1))
    assert timing._busy_wait_ms() == pytest.approx(16.0)  # still among the latest calls
    timing._dispatch_ms.clear()
    assert timing._busy_wait_ms() == pytest.approx(20.0)


def test_cuda_event_timer_without_the_private_busy_wait(monkeypatch):
    """A torch without ``torch.cuda._sleep``: nothing is queued before the start event, and
    the call is still timed (dispatch included)."""
    s, busy = _fake_cuda(monkeypatch, sleep=False), []
    ms = timing.cuda_event_timer(_step(s, busy))
    assert s.log == ["record", "fn", "record", "synchronize"] and busy == [False]
    assert ms == pytest.approx(5.0)


def test_cuda_event_timer_interleaves_variants_one_call_each(monkeypatch):
    s = _fake_cuda(monkeypatch)
    calls = []
    samples = timing.interleaved_samples(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, reps=2,
        timer=timing.cuda_event_timer)
    assert calls == ["a", "b", "a", "b", "b", "a"]
    assert {n: len(v) for n, v in samples.items()} == {"a": 2, "b": 2}
    assert s.log.count("busy-wait") == 2 + 6  # the calibration, then one before each call
