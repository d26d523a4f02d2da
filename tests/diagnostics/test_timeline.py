"""The interval algebra of the step timeline: merged intervals, their intersection, and the
hidden share of a timeline's communication."""

from __future__ import annotations

import pytest

from distllm.diagnostics.timeline import hidden, lanes, merge, overlap_ms


def test_timeline_interval_algebra():
    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap_ms([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    tl = [{"lane": "comm", "name": "ar", "start_ms": 1.0, "end_ms": 3.0},
          {"lane": "comm", "name": "ar", "start_ms": 2.0, "end_ms": 4.0},
          {"lane": "compute", "name": "mm", "start_ms": 0.0, "end_ms": 2.5}]
    assert hidden(tl) == (pytest.approx(3.0), pytest.approx(1.5))


class _Ev:
    """A profiler event as ``lanes`` reads it (times in µs)."""

    def __init__(self, name, start, end, device="DeviceType.CPU", thread=1):
        self.name, self.device_type, self.thread = name, device, thread
        self.time_range = type("R", (), {"start": start, "end": end})()


class _Prof:
    def __init__(self, evs):
        self.evs = evs

    def events(self):
        return self.evs


def test_on_a_gpu_the_comm_lane_is_the_nccl_kernels_not_their_launch():
    """A GEMM kernel, then an NCCL kernel not under it; the host's ``nccl:all_reduce`` range
    (the launch, 40 µs) ran beside the GEMM. It was in the comm lane: 5.6% "hidden" where
    nothing was. A gloo event (its worker thread) stays comm; the lane is in time order."""
    cuda = "DeviceType.CUDA"
    evs = [_Ev("aten::mm", 0, 30), _Ev("nccl:all_reduce", 0, 40),
           _Ev("ampere_sgemm", 10, 500, cuda, 7),
           _Ev("ncclDevKernel_AllReduce_Sum_f32", 600, 1100, cuda, 8),
           _Ev("gloo:all_reduce", 550, 560, thread=3)]
    tl = lanes(_Prof(evs))
    assert [e["name"] for e in tl if e["lane"] == "comm"] == [
        "gloo:all_reduce", "ncclDevKernel_AllReduce_Sum_f32"]
    assert [e["name"] for e in tl if e["lane"] == "compute"] == ["ampere_sgemm"]
    assert hidden(tl) == (pytest.approx(0.51), pytest.approx(0.0))
    # on the CPU alone, the host's collective events are the comm lane, ops the compute
    tl = lanes(_Prof([_Ev("aten::mm", 0, 30), _Ev("gloo:all_reduce", 10, 50, thread=3)]))
    assert [(e["lane"], e["name"]) for e in tl] == [("compute", "mm"),
                                                     ("comm", "gloo:all_reduce")]
