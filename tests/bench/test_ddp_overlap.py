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
        "distllm_ddp": 40.0, "torch_ddp": 38.0, "no_overlap": 55.0,
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
    # the sequential step against its parts in a row: 55 / 50 (they should add up)
    e = rows["no_overlap"]["extra"]
    assert (e["parts_ms"], e["vs_parts"]) == (50.0, pytest.approx(1.1))


def test_ddp_hidden_band_pairs_each_variant_with_the_parts_of_its_round():
    drift = [1.0, 1.3, 0.9, 1.2, 0.8, 1.1]
    st = {name: stats_of([ms * d for d in drift]) for name, ms in {
        "distllm_ddp": 40.0, "torch_ddp": 38.0, "no_overlap": 55.0,
        "fwd_alone": 10.0, "fwd_bwd_alone": 30.0, "comm_alone": 15.0, "opt_alone": 5.0,
    }.items()}
    st["torch_ddp"] = stats_of([38.0 * d for d in drift[::-1]])  # rounds out of step
    res = {"stats": st, "mem": {}, "timelines": {}}
    rows = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    assert rows["distllm_ddp"]["extra"]["hidden_band"] == pytest.approx(((50 - 40) / 15,) * 2)
    lo, hi = rows["torch_ddp"]["extra"]["hidden_band"]
    assert lo < 0.3 and hi > 1.2, (lo, hi)
    assert "hidden_band" not in rows["no_overlap"]["extra"]


def test_a_ddp_hidden_share_within_the_noise_of_its_parts_is_not_reported():
    """A 5 ms reduction beside a backward whose forward + backward spreads by 20 ms: a share
    of -100% or +200% there is the spread, so the row says n/r instead of printing it."""
    from distllm.bench.report import annotate, suite_table

    st = {name: _st(ms) for name, ms in {
        "distllm_ddp": 60.0, "torch_ddp": 62.0, "no_overlap": 55.0,
        "fwd_alone": 10.0, "comm_alone": 5.0, "opt_alone": 5.0,
    }.items()}
    st["fwd_bwd_alone"] = stats_of([35.0, 40.0, 45.0, 50.0, 55.0])  # p10..p90 16 ms wide
    res = {"stats": st, "mem": {}, "timelines": {}}
    rows = ddp_overlap._ddp_rows(res, "c", "loopback", "")
    got = {r["variant"]: r for r in rows}
    e = got["distllm_ddp"]["extra"]
    assert got["distllm_ddp"]["hidden_frac"] is None
    assert e["hidden_frac_unresolved"] == pytest.approx((45 + 5 + 5 - 60) / 5)
    assert "within the spread" in e["hidden_unresolved"] and "16 ms" in e["hidden_unresolved"]
    for r in rows:
        r["status"] = "ok"
    line = next(x for x in suite_table(annotate(rows)).splitlines() if "| distllm_ddp |" in x)
    assert "| n/r |" in line and "⚠" not in line
    # the spread of a part that is not what can hide (the optimizer step) counts too
    st["fwd_bwd_alone"], st["opt_alone"] = _st(45.0), stats_of([1.0, 3.0, 5.0, 7.0, 9.0])
    got = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    assert got["distllm_ddp"]["hidden_frac"] is None
    assert "6.4 ms" in got["distllm_ddp"]["extra"]["hidden_unresolved"]
    # the same parts, steady: the share is reported
    st["opt_alone"] = _st(5.0)
    got = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    assert got["distllm_ddp"]["hidden_frac"] == pytest.approx((45 + 5 + 5 - 60) / 5)
    assert "hidden_unresolved" not in got["distllm_ddp"]["extra"]


def test_targets_ddp_not_slower_than_torch_over_a_link_and_zero_within_its_bars():
    parts = {"fwd_alone": 10.0, "fwd_bwd_alone": 33.0, "comm_alone": 15.0, "opt_alone": 7.0}

    def ddp(ours: float, net: str) -> dict:
        st = {n: _st(ms) for n, ms in {"distllm_ddp": ours, "torch_ddp": 40.0,
                                       "no_overlap": 55.0, **parts}.items()}
        rows = ddp_overlap._ddp_rows({"stats": st, "mem": {}, "timelines": {}}, "c", net, "")
        return {r["variant"]: r for r in rows}["distllm_ddp"]["extra"]

    assert ddp(40.0, "10gbit")["meets_target"] and not ddp(40.4, "10gbit")["meets_target"]
    assert ddp(41.0, "loopback")["meets_target"]  # loopback keeps its 3% band
    mem = {"grads": 1.0, "optimizer": 2.0, "total": 4.0}
    st = {n: _st(ms) for n, ms in {"distllm_ddp": 100.0, "zero2": 105.0, "zero3": 125.5}.items()}
    res = {"stats": st, "missing": {}, "timelines": {},
           "mem": {"distllm_ddp": mem, "zero2": {"grads": 0.5, "optimizer": 1.0, "total": 2.5},
                   "zero3": {"grads": 0.5, "optimizer": 1.0, "total": 2.0}}}
    rows = {r["variant"]: r["extra"] for r in ddp_overlap._zero_rows(res, "c", "10gbit", "")}
    assert rows["zero2"]["meets_target"] and rows["zero2"]["target"].startswith("<= 1.05x")
    assert not rows["zero3"]["meets_target"] and rows["zero3"]["target"].startswith("<= 1.25x")


def test_auto_row_says_what_it_chose_and_how_it_ran_against_both_schedules():
    st = {name: _st(ms) for name, ms in {
        "distllm_ddp": 40.0, "torch_ddp": 38.0, "no_overlap": 36.0, "ddp_auto": 37.0,
        "fwd_alone": 10.0, "fwd_bwd_alone": 30.0, "comm_alone": 15.0, "opt_alone": 5.0,
    }.items()}
    chose = {"auto_decision": "after backward (its steps took 0.9 ...)", "auto_overlaps": False,
             "auto_trial_steps": 13}
    res = {"stats": st, "mem": {}, "timelines": {}, "auto": {"ddp_auto": chose}}
    e = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}[
        "ddp_auto"]["extra"]
    assert {k: e[k] for k in chose} == chose
    assert e["vs_distllm_ddp"] == pytest.approx(37 / 40)
    assert e["vs_no_overlap"] == pytest.approx(37 / 36)
    assert e["vs_best_schedule"] == pytest.approx(37 / 36)  # the faster of the two: 36 ms


_PARTS_MS = {"fwd_alone": 10.0, "fwd_bwd_alone": 30.0, "comm_alone": 15.0, "opt_alone": 5.0}


def test_variants_that_did_not_build_are_rows_and_ratios_skip_them():
    """A variant that failed to build is an unavailable row with its error; a missing
    torch_ddp, no_overlap or distllm_ddp leaves out the ratios to it, not the case."""
    st = {n: _st(ms) for n, ms in {"distllm_ddp": 40.0, "torch_ddp": 38.0, "no_overlap": 55.0,
                                   **_PARTS_MS}.items()}
    res = {"stats": st, "missing": {"ddp_auto": "RuntimeError: trial failed"}, "mem": {},
           "timelines": {}}
    got = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    assert (got["ddp_auto"]["status"], got["ddp_auto"]["reason"]) == (
        "unavailable", "RuntimeError: trial failed")
    assert got["distllm_ddp"]["extra"]["vs_torch_ddp"] == pytest.approx(40 / 38)
    del st["torch_ddp"], st["no_overlap"]
    st["ddp_auto"] = _st(39.0)
    res.update(missing={"torch_ddp": "ImportError: x", "no_overlap": "ImportError: x"},
               auto={"ddp_auto": {"auto_overlaps": True}})
    got = {r["variant"]: r for r in ddp_overlap._ddp_rows(res, "c", "loopback", "")}
    assert {n: got[n]["status"] for n in ("torch_ddp", "no_overlap", "distllm_ddp")} == {
        "torch_ddp": "unavailable", "no_overlap": "unavailable", "distllm_ddp": "ok"}
    e = got["distllm_ddp"]["extra"]
    assert "vs_torch_ddp" not in e and "meets_target" not in e
    assert e["vs_ideal"] == pytest.approx(40 / (10 + 20 + 5))  # ideal from the parts
    e = got["ddp_auto"]["extra"]
    assert "vs_no_overlap" not in e and e["auto_overlaps"] is True
    assert e["vs_distllm_ddp"] == e["vs_best_schedule"] == pytest.approx(39 / 40)
    # the sweep: the missing bucket size is a row; without torch_ddp, no ratio to it
    sw = {"stats": {"ddp_cap1": _st(41.0)}, "mem": {},
          "missing": {"ddp_cap5": "OSError: y", "torch_ddp": "ImportError: x"}}
    got = {r["variant"]: r for r in ddp_overlap._sweep_rows(sw, "c", "loopback", "")}
    assert {n: (r["case"], r["status"]) for n, r in got.items()} == {
        "ddp_cap1": ("c sweep", "ok"), "ddp_cap5": ("c sweep", "unavailable"),
        "torch_ddp": ("c sweep", "unavailable")}
    assert got["ddp_cap1"]["extra"]["vs_torch_ddp"] is None
    # ZeRO without distllm_ddp: its rows, no ratios to it
    zr = {"stats": {"zero2": _st(50.0)}, "missing": {"distllm_ddp": "E: z"}, "timelines": {},
          "mem": {"zero2": {"grads": 1.0, "optimizer": 1.0, "total": 3.0}}}
    got = {r["variant"]: r for r in ddp_overlap._zero_rows(zr, "c", "loopback", "")}
    assert got["distllm_ddp"]["status"] == "unavailable" and got["zero2"]["status"] == "ok"
    assert not {"vs_ddp", "meets_target", "grad_opt_vs_ddp"} & set(got["zero2"]["extra"])


def test_shares_from_parts_that_do_not_add_up_are_flagged():
    """no_overlap's step against its parts in a row, round by round: 1.31x beyond the band
    says the parts miss part of the step, so every share computed from them is wrong (a
    share of -108% here): flagged with the report's measurement-error mark and note."""
    from distllm.bench import report

    drift = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03]

    def rows(no_overlap: float, ours: float) -> dict:
        st = {n: stats_of([ms * d for d in drift]) for n, ms in {
            "distllm_ddp": ours, "torch_ddp": 52.0, "no_overlap": no_overlap,
            **_PARTS_MS}.items()}
        got = ddp_overlap._ddp_rows({"stats": st, "mem": {}, "timelines": {}}, "c",
                                    "loopback", "")
        return {r["variant"]: r for r in report.annotate(got)}

    got = rows(50.0 * 1.31, 50.0 + 1.08 * 15)  # parts 50 ms, what can hide 15 ms
    e = got["no_overlap"]["extra"]
    assert e["vs_parts"] == pytest.approx(1.31) and e["parts_add_up"] is False
    assert e["vs_parts_band"] == pytest.approx((1.31, 1.31))
    ours = got["distllm_ddp"]
    assert ours["hidden_frac"] == pytest.approx(-1.08)
    assert ours["extra"]["parts_add_up"] is False and ours["extra"]["below_floor"] is True
    assert got["torch_ddp"]["extra"]["below_floor"] is True  # a share of -13%: same parts
    table = report.suite_table(list(got.values()))
    assert "| -108% (-108..-108) ⚠ |" in table and report.FLOOR_NOTE in table
    # parts that add up (no_overlap within their band), a share above the floor: no flag
    got = rows(50.0, 45.0)
    assert got["no_overlap"]["extra"]["parts_add_up"] is True
    assert got["distllm_ddp"]["extra"]["below_floor"] is False
    assert report.FLOOR_NOTE not in report.suite_table(list(got.values()))


def _broken_step(shape, x, dims, cap):
    """A variant that builds, and whose step raises on every rank."""
    def step():
        raise RuntimeError("no step here")

    return step, dict


def _setup_with_a_broken_variant(phase: str) -> tuple[list[str], dict[str, str]]:
    """One rank's setup of ``phase`` with ``distllm_ddp`` and a variant that builds but cannot
    step: the variants it times and those it reports unavailable."""
    from distllm.bench.harness import BenchConfig, Case

    ddp_overlap._BUILDERS["broken"] = _broken_step
    ddp_overlap.PHASES[phase] = ["distllm_ddp", "broken"]
    s = ddp_overlap.setup(BenchConfig(quick=True), Case(phase, {"phase": phase}, ranks=2))
    return sorted(s.variants), s.unavailable


def test_a_variant_that_fails_its_first_step_is_a_row():
    """Only building sat inside the try: a variant that built and failed on its first step
    failed the timing, and the whole case with it."""
    from distllm.testing import run_distributed

    for variants, missing in run_distributed(_setup_with_a_broken_variant, 2, "zero",
                                             timeout=120):
        assert variants == ["distllm_ddp"]
        assert missing == {"broken": "its first step failed: RuntimeError: no step here"}


def test_ddp_and_zero_targets_are_judged_on_their_bands():
    """distllm_ddp at the median of torch_ddp (its target over a link: not slower) but slower
    in half the rounds; zero3 inside its bar at the median, outside it in half the rounds:
    "met" came from the medians alone."""
    parts = {n: stats_of([ms] * 10) for n, ms in {"fwd_alone": 10.0, "fwd_bwd_alone": 33.0,
                                                   "comm_alone": 15.0, "opt_alone": 7.0}.items()}
    torch_ddp = [40.0] * 10
    mixed = [39.0, 41.0] * 5  # median 40: 1.0x of torch's; rounds at 0.975x and 1.025x
    st = {"distllm_ddp": stats_of(mixed), "torch_ddp": stats_of(torch_ddp),
          "no_overlap": stats_of([55.0] * 10), **parts}
    rows = ddp_overlap._ddp_rows({"stats": st, "mem": {}, "timelines": {}}, "c", "10gbit", "")
    e = {r["variant"]: r for r in rows}["distllm_ddp"]["extra"]
    assert e["meets_target"] is True and e["target_status"] == "within the spread"
    st["distllm_ddp"] = stats_of([38.0, 39.0] * 5)
    rows = ddp_overlap._ddp_rows({"stats": st, "mem": {}, "timelines": {}}, "c", "10gbit", "")
    e = {r["variant"]: r for r in rows}["distllm_ddp"]["extra"]
    assert e["target_status"] == "met" and e["target_judged_on"] == "p10..p90 round by round"
    ddp = stats_of([100.0] * 10)
    st = {"distllm_ddp": ddp, "zero3": stats_of([120.0, 130.0] * 5)}  # median 125 <= 1.25x
    res = {"stats": st, "missing": {}, "timelines": {}, "mem": {}}
    e = {r["variant"]: r["extra"] for r in ddp_overlap._zero_rows(res, "c", "10gbit", "")}
    assert e["zero3"]["meets_target"] is True
    assert e["zero3"]["target_status"] == "within the spread"
