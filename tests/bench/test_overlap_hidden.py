"""The overlap suites' hidden share, from synthetic timings: each variant is measured against
its own parts (its compute and its collectives, each alone and run its way), as a share of
what could hide, so that it cannot exceed 1 unless the measurement is wrong."""

from __future__ import annotations

import pytest
from distllm.bench import ddp_overlap, row_parallel_overlap
from distllm.bench.harness import stats_of


def _st(ms: float):
    return stats_of([ms * 0.98, ms, ms * 1.02])  # min = 0.98 ms


def test_row_overlap_hidden_uses_each_variants_own_parts():
    res = {name: _st(ms) for name, ms in {
        "allreduce": 20.0,  # one blocking all-reduce of the whole tensor
        "gemm": 10.0, "gemm_chunked4": 11.0, "sequential": 30.0,
        "chunked4": 25.0, "auto": 26.0,
        "compute_alone_c0": 10.0, "comm_alone_c0": 20.0,
        "compute_alone_c4": 12.0, "comm_alone_c4": 24.0,  # chunked: slower parts
    }.items()}
    info = {"forward": {"chunks": 4, "reason": "4 chunks"}}
    rows = {r["variant"]: r for r in row_parallel_overlap._case_rows(
        "row_overlap", "fwd", (8, 8, 8), res, info, "loopback", "float32")}
    # (12 + 24 - 25) / min(12, 24): the share of its own hideable time; against the blocking
    # all-reduce and the sequential time it would read (30 - 25) / 20 = 25%
    assert rows["chunked4"]["hidden_frac"] == pytest.approx(11 / 12)
    assert rows["auto"]["hidden_frac"] == pytest.approx(10 / 12)  # auto ran 4 chunks
    e = rows["chunked4"]["extra"]
    assert (e["compute_ms"], e["comm_ms"], e["hideable_ms"], e["hidden_ceiling"]) == (
        12.0, 24.0, 12.0, 1.0)
    assert e["hidden_frac_min"] == pytest.approx((12 + 24 - 25) * 0.98 / (12 * 0.98))
    for part in ("compute_alone_c4", "comm_alone_c0", "gemm", "allreduce"):
        assert rows[part]["extra"]["role"] == "part" and rows[part]["hidden_frac"] is None
    assert rows["sequential"]["hidden_frac"] is None  # the baseline
    assert rows["ideal"]["hidden_frac"] == pytest.approx(1.0)


def test_row_overlap_hidden_share_bounds():
    assert row_parallel_overlap.hidden_share(30.0, 10.0, 20.0) == 0.0  # nothing hidden
    assert row_parallel_overlap.hidden_share(20.0, 10.0, 20.0) == 1.0  # all of the GEMM
    assert row_parallel_overlap.hidden_share(19.0, 10.0, 20.0) > 1.0  # impossible: flagged
    assert row_parallel_overlap.hidden_share(5.0, 0.0, 5.0) is None  # nothing could hide


def test_ddp_hidden_is_a_share_of_the_backward_it_can_hide_under():
    st = {name: _st(ms) for name, ms in {
        "distllm_ddp": 40.0, "torch_ddp": 38.0, "no_overlap": 55.0,  # its one flat all-reduce
        "fwd_alone": 10.0, "fwd_bwd_alone": 30.0, "comm_alone": 15.0, "opt_alone": 5.0,
    }.items()}
    res = {"stats": st, "mem": {}, "timelines": {}}
    rows = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    # parts in a row: 10 + 20 + 15 + 5 = 50; what can hide: min(bwd 20, comm 15) = 15
    assert rows["distllm_ddp"]["hidden_frac"] == pytest.approx((50 - 40) / 15)
    assert rows["torch_ddp"]["hidden_frac"] == pytest.approx((50 - 38) / 15)
    e = rows["distllm_ddp"]["extra"]
    assert (e["bwd_ms"], e["comm_ms"], e["hideable_ms"], e["hidden_ceiling"]) == (
        20.0, 15.0, 15.0, 1.0)
    assert rows["no_overlap"]["hidden_frac"] is None
