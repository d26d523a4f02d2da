"""The DDP benchmark's hidden share, from synthetic timings: the share of the backward that
the gradient reduction can hide under, from the parts alone."""

from __future__ import annotations

import pytest
from distllm.bench import ddp_overlap

from distllm.diagnostics.timing import stats_of


def _st(ms: float):
    return stats_of([ms * 0.98, ms, ms * 1.02])


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
