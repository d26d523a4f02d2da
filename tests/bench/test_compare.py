"""`distllm bench --compare`: synthetic result files with a known regression, and changes
within the measured spread that must not be flagged."""

from __future__ import annotations

import json

import pytest
from distllm.bench import compare, suite
from distllm.bench.rows import row

from distllm.cli import main
from distllm.diagnostics.timing import stats_of


def _r(variant, ms, spread=0.05, case="1,2,3", suite_="s", status="ok", reason=""):
    if status != "ok":
        return row(suite_, case, variant, status=status, reason=reason)
    st = stats_of([ms * (1 - spread), ms * (1 - spread / 2), ms, ms * (1 + spread / 2),
                   ms * (1 + spread)])
    r = row(suite_, case, variant, st)
    del r["extra"]["samples_ms"]  # as results of earlier runs hold them: bands unpaired
    return r


def _kinds(old, new, **kw):
    return {c.variant: c.kind for c in compare.compare_rows(old, new, **kw)}


def test_compare_flags_only_beyond_spread():
    old = [_r("unfused", 20.0), _r("fused", 10.0), _r("torch", 15.0), _r("auto", 10.0, 0.3),
           _r("cuda", 3.0)]
    new = [_r("unfused", 20.2), _r("fused", 13.0),  # 30% slower, bands disjoint
           _r("torch", 15.3),  # +2%, inside the 5% bands
           _r("auto", 12.0, 0.3),  # +20% but the old band is +-30%
           _r("cuda", 0, status="unavailable", reason="no CUDA here"), _r("brand_new", 1.0)]
    kinds = _kinds(old, new)
    assert kinds == {"unfused": "same", "fused": "slower", "torch": "same", "auto": "same",
                     "cuda": "lost", "brand_new": "new"}
    regs = compare.regressions(compare.compare_rows(old, new))
    assert sorted(c.variant for c in regs) == ["cuda", "fused"]
    # with a tolerance wider than the change, the slowdown is no longer flagged
    assert _kinds(old, new, tolerance=0.35)["fused"] == "same"
    # faster beyond the spread is an improvement, not a regression
    assert _kinds([_r("fused", 10.0)], [_r("fused", 7.0)]) == {"fused": "faster"}


def test_compare_flags_lost_speedup_across_machines():
    # every time halved (a faster machine) but the fused path lost its edge over unfused
    old = [_r("unfused", 20.0), _r("fused", 10.0)]
    new = [_r("unfused", 5.5), _r("fused", 5.0)]
    changes = {c.variant: c for c in compare.compare_rows(old, new)}
    assert changes["fused"].kind == "lost speed-up" and changes["fused"].regression
    assert changes["fused"].old_speedup == pytest.approx(2.0)
    assert changes["fused"].new_speedup == pytest.approx(1.1)
    table = compare.compare_table(list(changes.values()), {"host_cpu": "a"}, {"host_cpu": "b"})
    assert "1 regression(s)" in table and "REGRESSION (lost speed-up)" in table
    assert "machines differ" in table


def test_winner_agreement():
    old = [_r("unfused", 20.0, case="a"), _r("fused", 10.0, case="a"),
           _r("unfused", 10.0, case="b"), _r("fused", 9.0, case="b"),
           _r("unfused", 10.0, case="c"), _r("fused", 5.0, case="c"), _r("ideal", 1.0, case="c"),
           _r("fused-auto", 5.0, case="d"), _r("fused-cpu", 6.0, case="d")]
    new = [_r("unfused", 21.0, case="a"), _r("fused", 11.0, case="a"),
           _r("fused-auto", 7.0, case="d"), _r("fused-cpu", 5.0, case="d"),
           _r("unfused", 9.2, 0.1, case="b"), _r("fused", 9.6, 0.1, case="b"),  # bands overlap
           _r("unfused", 5.0, case="c"), _r("fused", 10.0, case="c"), _r("ideal", 1.0, case="c")]
    got = {c: (o, n, v) for _, c, o, n, v in compare.winners(old, new)}
    assert got == {"a": ("fused", "fused", "same"), "b": ("fused", "unfused", "within spread"),
                   "c": ("fused", "unfused", "changed"),  # the ideal bound is no contender
                   "d": ("fused-auto", "fused-cpu", "same kind (fused)")}
    assert "3 of 4 cases agree" in compare.winners_table(compare.winners(old, new))


def _write(tmp, rows):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "results.json").write_text(json.dumps({"machine": {"time": "t"}, "rows": rows}))
    return tmp


def test_cli_fail_on_regression(tmp_path, monkeypatch, capsys):
    """The synthetic suite's fused variant sleeps 2 ms: against an old run that recorded
    0.5 ms it is a regression (exit 1); against a 2 ms old run with a wide band it is not."""
    monkeypatch.setattr(suite, "SUITES", {
        "fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic")})
    case = "1,2,3"
    fast = _write(tmp_path / "fast", [_r("unfused", 20.0, 0.3, case, "fake"),
                                      _r("fused", 0.5, 0.1, case, "fake")])
    same = _write(tmp_path / "same", [_r("unfused", 20.0, 0.9, case, "fake"),
                                      _r("fused", 2.0, 0.9, case, "fake")])
    args = ["bench", "--suite", "fake", "--shapes", case, "--reps", "3", "--no-progress"]
    rc = main([*args, "--out", str(tmp_path / "n1"), "--compare", str(fast),
               "--fail-on-regression"])
    out = capsys.readouterr()
    assert rc == 1, out.out
    cmp_md = (tmp_path / "n1" / "COMPARE.md").read_text()
    assert "REGRESSION (slower)" in cmp_md and "1 of 1 cases agree" in cmp_md
    assert "regression(s) beyond the measured spread" in out.err
    # without --fail-on-regression the same finding is reported but the exit code is 0
    assert main([*args, "--out", str(tmp_path / "n2"), "--compare", str(fast)]) == 0
    rc = main([*args, "--out", str(tmp_path / "n3"), "--compare", str(same),
               "--fail-on-regression"])
    assert rc == 0, capsys.readouterr().out
    bad = _write(tmp_path / "bad", [])
    (bad / "results.json").write_text("[1, 2]")
    assert main([*args, "--out", str(tmp_path / "n4"), "--compare", str(bad)]) == 2
    assert "not a distllm bench results.json" in capsys.readouterr().err
