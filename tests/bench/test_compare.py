"""`distllm bench --compare`: synthetic result files with a known regression, and changes
within the measured spread that must not be flagged."""

from __future__ import annotations

import json
import re

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


def test_a_computed_bound_is_not_judged():
    """An ``ideal`` row (max of two medians, no repetitions of its own) has no spread: any
    change of it was flagged a regression, though the rows it comes from were not."""
    def ideal(ms):
        r = row("s", "1,2,3", "ideal", None, role="ideal")
        r.update(ms=ms)
        return r

    old, new = [_r("gemm", 10.0, 0.3), ideal(10.0)], [_r("gemm", 12.0, 0.3), ideal(12.0)]
    changes = {c.variant: c for c in compare.compare_rows(old, new)}
    assert changes["gemm"].kind == "same" and changes["ideal"].kind == "same"
    assert "not timed" in changes["ideal"].note and not compare.regressions(changes.values())


def test_rows_of_other_shapes_under_one_case_name_are_not_compared():
    """The pipeline suite's case names leave out the stage (a quick run's 4 ms sleeps, a full
    run's 10 ms) and the overhead case its batch: their rows' shape tells them apart, so a
    quick run against a full one reads as other cases, not as a speed-up."""
    def at(ms, shape):
        r = _r("1f1b", ms, case="sleep p=4 m=4")
        r["shape"] = shape
        return r

    changes = compare.compare_rows([at(100.0, "10 ms x4")], [at(40.0, "4 ms x4")])
    assert sorted((c.case, c.kind, c.note) for c in changes) == [
        ("sleep p=4 m=4 [10 ms x4]", "lost", "not in the new run"),
        ("sleep p=4 m=4 [4 ms x4]", "new", "")]
    assert _kinds([at(100.0, "10 ms x4")], [at(40.0, "10 ms x4")]) == {"1f1b": "faster"}
    # a shape the case name already carries changes nothing
    r = _r("gemm", 10.0, case="fwd 8,4,2 loopback")
    r["shape"] = "8x4x2"
    assert compare._key(r) == ("s", "fwd 8,4,2 loopback", "gemm")


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


def _this_machine() -> dict:
    """The fields that tell machines apart, as a run here records them."""
    from distllm.bench.rows import machine_info

    m = machine_info()
    return {"time": "t", "host_cpu": m["host_cpu"], "gpu": m["gpu"]}


def _write(tmp, rows, machine=None):
    """An earlier run's results.json: ``rows``, measured on this machine unless ``machine``."""
    tmp.mkdir(parents=True, exist_ok=True)
    data = {"machine": _this_machine() if machine is None else machine, "rows": rows}
    (tmp / "results.json").write_text(json.dumps(data))
    return tmp


def test_cli_fail_on_regression(tmp_path, monkeypatch, capsys):
    """The synthetic suite's fused variant sleeps 2 ms: against an old run that recorded
    0.5 ms it is a regression (exit 1); against a 2 ms old run with a wide band it is not."""
    monkeypatch.setattr(suite, "SUITES", {
        "fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic", shape="M,K,N",
                            shape_dims=(3,))})
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


def test_times_of_another_machine_are_no_verdict():
    """Old run on machine A, new run on a machine 2x slower: every time rose beyond the
    spread, yet the speed-ups (ratios within each run) held: no regression, the time change
    a note. A speed-up that fell is one. On one machine the same times are ``slower``."""
    a, b = {"host_cpu": "cpu A", "gpu": None}, {"host_cpu": "cpu B", "gpu": None}
    old = [_r("unfused", 20.0), _r("fused", 10.0), _r("torch", 15.0)]
    new = [_r("unfused", 40.0), _r("fused", 20.0), _r("torch", 30.0)]
    changes = compare.compare_rows(old, new, old_machine=a, new_machine=b)
    assert compare.regressions(changes) == [], [(c.variant, c.kind) for c in changes]
    assert {c.variant: c.kind for c in changes} == dict.fromkeys(old_names := [
        "unfused", "fused", "torch"], "same")
    assert all("time slower beyond the spread, on another machine" in c.note for c in changes)
    table = compare.compare_table(changes, a, b)
    assert "0 regression(s)" in table and "REGRESSION" not in table
    assert "The machines differ: their times are not comparable" in table
    # the same rows on one machine: every variant slower, each a regression
    same = compare.compare_rows(old, new, old_machine=a, new_machine=dict(a))
    assert sorted(c.variant for c in compare.regressions(same)) == sorted(old_names)
    assert not compare.machines_differ(a, dict(a, time="later")) and compare.machines_differ(a, b)
    assert not compare.machines_differ(None, {})  # neither known: rows compared alone
    # on the slower machine the fused variant lost its edge: a regression, whatever the times
    lost = [_r("unfused", 40.0), _r("fused", 36.0), _r("torch", 30.0)]
    changes = {c.variant: c for c in compare.compare_rows(old, lost, old_machine=a,
                                                           new_machine=b)}
    assert [c.variant for c in compare.regressions(changes.values())] == ["fused"]
    assert changes["fused"].kind == "lost speed-up"
    # and a faster machine's times are no improvement either
    quick = compare.compare_rows(new, old, old_machine=b, new_machine=a)
    assert {c.kind for c in quick} == {"same"}


def test_cli_another_machine_fails_only_on_a_lost_speed_up(tmp_path, monkeypatch, capsys):
    """``--fail-on-regression`` against a run of another machine whose fused variant took
    0.5 ms (1.2x faster than unfused): the new run's 2 ms (10x faster than its unfused) is a
    note (exit 0); a fused variant that lost its speed-up over unfused fails (exit 1)."""
    monkeypatch.setattr(suite, "SUITES", {
        "fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic", shape="M,K,N",
                            shape_dims=(3,))})
    case, other = "1,2,3", {"time": "t", "host_cpu": "another CPU", "gpu": "another GPU"}
    fast = _write(tmp_path / "fast", [_r("unfused", 0.6, 0.05, case, "fake"),
                                      _r("fused", 0.5, 0.05, case, "fake")], other)
    args = ["bench", "--suite", "fake", "--shapes", case, "--reps", "3", "--no-progress",
            "--fail-on-regression"]
    rc = main([*args, "--out", str(tmp_path / "n1"), "--compare", str(fast)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    cmp_md = (tmp_path / "n1" / "COMPARE.md").read_text()
    assert "0 regression(s)" in cmp_md and "The machines differ" in cmp_md
    assert "time slower beyond the spread, on another machine" in cmp_md
    # the old fused variant ran 200x faster than unfused: the new one's 10x is a lost speed-up
    edge = _write(tmp_path / "edge", [_r("unfused", 100.0, 0.05, case, "fake"),
                                      _r("fused", 0.5, 0.05, case, "fake")], other)
    rc = main([*args, "--out", str(tmp_path / "n2"), "--compare", str(edge)])
    out = capsys.readouterr()
    assert rc == 1, out.out
    assert "REGRESSION (lost speed-up)" in (tmp_path / "n2" / "COMPARE.md").read_text()


def test_a_case_or_suite_that_failed_in_the_new_run_is_a_regression():
    """A case that raised leaves one error row (variant "-", case = its label), not the rows
    of the old run, whose case names carry the network: every old row it stands for is
    ``lost``, with the error as the note, and the error row is not listed on its own."""
    old = [_r("sequential", 30.0, case="fwd 8,8,8 loopback", suite_="row"),
           _r("chunked4", 20.0, case="fwd 8,8,8 loopback", suite_="row"),
           _r("sequential", 30.0, case="bwd 8,8,8 loopback", suite_="row")]
    new = [_r("-", 0, case="fwd 8,8,8", suite_="row", status="error", reason="RuntimeError: x"),
           _r("sequential", 30.0, case="bwd 8,8,8 loopback", suite_="row")]
    ch = {(c.case, c.variant): c for c in compare.compare_rows(old, new)}
    assert {k: c.kind for k, c in ch.items()} == {
        ("fwd 8,8,8 loopback", "sequential"): "lost", ("fwd 8,8,8 loopback", "chunked4"): "lost",
        ("bwd 8,8,8 loopback", "sequential"): "same"}
    assert ch[("fwd 8,8,8 loopback", "chunked4")].note == (
        "case fwd 8,8,8: error: RuntimeError: x")
    assert len(compare.regressions(list(ch.values()))) == 2
    # a suite that failed as a whole (case "-") stands for every old row of that suite
    whole = [_r("-", 0, case="-", suite_="row", status="error", reason="ImportError: y")]
    ch = compare.compare_rows(old, whole)
    assert [c.kind for c in ch] == ["lost"] * 3
    assert ch[0].note == "the whole suite: error: ImportError: y"
    # an old ok row missing from a suite the new run ran, with no failure row: lost too
    ch = compare.compare_rows(old, new[1:])
    assert sorted(c.kind for c in ch) == ["lost", "lost", "same"]
    assert {c.note for c in ch if c.kind == "lost"} == {"not in the new run"}
    # a suite the new run did not run at all is gone, not a regression
    ch = compare.compare_rows(old, [_r("fused", 1.0, suite_="other")])
    assert {c.kind for c in ch if c.suite == "row"} == {"gone"}
    assert not compare.regressions(ch)


def test_failure_rows_match_the_case_label_the_runner_records():
    """Row case names need not contain the label (the DDP suite names its cases by network
    and model); the runner records the label as ``extra.case_label``."""
    a = _r("distllm_ddp", 40.0, case="loopback 1.6M b2s16h256", suite_="ddp")
    b = _r("distllm_ddp", 40.0, case="loopback 1.6M b2s16h256 sweep", suite_="ddp")
    a["extra"]["case_label"], b["extra"]["case_label"] = "ddp", "sweep"
    new = [_r("-", 0, case="ddp", suite_="ddp", status="error", reason="OSError: z"),
           _r("distllm_ddp", 40.0, case="loopback 1.6M b2s16h256 sweep", suite_="ddp")]
    kinds = {c.case: c.kind for c in compare.compare_rows([a, b], new)}
    assert kinds == {"loopback 1.6M b2s16h256": "lost", "loopback 1.6M b2s16h256 sweep": "same"}


def test_the_runner_labels_rows_and_a_crashed_case_fails_the_comparison(monkeypatch):
    """End to end through the runner: the fake suite's rows, then the same suite with a
    setup() that raises: every old row is lost, and the winners table lists the case as
    measured in the old run only."""
    from tests.bench import fake_suites

    reg = {"fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic")}
    # (medians of 5: of 2, one sleep of 2 ms overrun by a loaded machine's scheduler past
    # 20 ms made "unfused" the old run's winner once in CI)
    cfg = suite.BenchConfig(reps=5, shapes="1,2,3")
    old = suite.run_suites(["fake"], cfg, progress=False, registry=reg).rows
    assert {r["extra"]["case_label"] for r in old} == {"1,2,3"}

    def boom(cfg, case):
        raise RuntimeError("setup failed")

    monkeypatch.setattr(fake_suites, "setup", boom)
    new = suite.run_suites(["fake"], cfg, progress=False, registry=reg).rows
    assert [(r["case"], r["variant"], r["status"]) for r in new] == [("1,2,3", "-", "error")]
    ch = compare.compare_rows(old, new)
    assert sorted((c.variant, c.kind) for c in ch) == [  # fused_cuda: unavailable in both
        ("fused", "lost"), ("fused_cuda", "same"), ("torch_peer", "lost"), ("unfused", "lost")]
    assert len(compare.regressions(ch)) == 3
    wins = compare.winners(old, new)
    assert wins == [("fake", "1,2,3", "fused", "-", "only in the old run")]
    table = compare.winners_table(wins)
    assert "0 of 0 cases agree" in table and "1 case(s) ran in one run only" in table
    assert "| fake | 1,2,3 | fused | - | only in the old run |" in table


def test_winners_list_cases_of_one_run():
    old = [_r("unfused", 20.0, case="a"), _r("fused", 10.0, case="a"),
           _r("unfused", 20.0, case="gone"), _r("fused", 10.0, case="gone")]
    new = [_r("unfused", 20.0, case="a"), _r("fused", 10.0, case="a"),
           _r("torch", 5.0, case="new")]
    # a suite the other run did not run at all is left out (not a finding)
    old += [_r("fused", 1.0, case="x", suite_="not_run_now")]
    new += [_r("fused", 1.0, case="y", suite_="not_run_before")]
    assert compare.winners(old, new) == [
        ("s", "a", "fused", "fused", "same"),
        ("s", "gone", "fused", "-", "only in the old run"),
        ("s", "new", "-", "torch", "only in the new run")]
    assert "1 of 1 cases agree" in compare.winners_table(compare.winners(old, new))


def test_an_unreadable_results_file_is_one_line_naming_compare(tmp_path):
    from distllm.bench.compare import load_results

    (tmp_path / "results.json").write_text("not json")
    with pytest.raises(ValueError, match=r"^--compare: .*results.json cannot be read as JSON "
                                         r"\(Expecting value: line 1 column 1 \(char 0\)\); "
                                         r"give the --out folder"):
        load_results(tmp_path)
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(ValueError, match="is not a distllm bench results.json"):
        load_results(tmp_path)


@pytest.mark.parametrize("data,why", [
    ({"rows": [], "machine": "zen4"}, "results.json has a 'machine' of type str, not the dict"),
    ({"rows": ["x"]}, "row 0 of .* is a str, not a result row"),
    ({"rows": [{"suite": "s", "case": "c", "variant": "v", "status": "ok", "ms": 1.0},
               {"suite": "s", "case": "c", "status": "ok"}]}, "row 1 of .* has no variant"),
    ({"rows": [{"suite": "s", "case": "c", "variant": "v", "status": "ok", "ms": "fast"}]},
     "row 0 of .* has a ms of 'fast', not a number"),
])
def test_a_malformed_results_file_is_refused_when_read(tmp_path, data, why):
    """A machine that is not a dict was a TypeError; a row that is not a dict, or lacks what
    the comparison reads, passed the load and crashed after the whole benchmark ran."""
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^--compare {re.escape(str(tmp_path))}: {why}"):
        compare.load_results(tmp_path)


@pytest.mark.parametrize("data", [{"rows": [], "machine": "zen4"}, {"rows": ["x"]}])
def test_a_malformed_results_file_exits_2_before_any_benchmark(tmp_path, monkeypatch, capsys,
                                                               data):
    """Through the command: one line naming --compare, exit 2, and no suite run."""
    class Ran(Exception):
        pass

    def run_suites(*a, **k):  # a benchmark would run now: too late to refuse the file
        raise Ran

    monkeypatch.setattr(suite, "run_suites", run_suites)
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps(data))
    try:
        rc = main(["bench", "--suite", "linear_gelu", "--quick", "--no-progress", "--out",
                   str(tmp_path / "new"), "--compare", str(old)])
    except Ran:
        rc = "the benchmark ran"
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"distllm bench: error: --compare {old}: "), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "new").exists()


def test_machines_with_one_cpu_name_and_other_core_counts_differ():
    """A QEMU guest reports one generic CPU name at any size: 16 cores then 2 read as one
    machine, and the old run's absolute times gave a regression."""
    old = {"host_cpu": "Intel(R) Xeon(R) Processor", "cores": 16, "gpu": None}
    new = dict(old, cores=2)
    assert compare.machines_differ(old, new)
    assert not compare.machines_differ(old, dict(old))
    assert not compare.machines_differ(old, {"host_cpu": old["host_cpu"], "gpu": None})
    assert compare.machines_differ(dict(old, torch="2.5.1"), dict(old, torch="2.6.0"))
    assert compare.machines_differ(dict(old, cuda="12.4"), dict(old, cuda="13.0"))
    assert not compare.machines_differ(dict(old, torch="2.5.1"), old)  # one run names none

    def r(ms):
        return {"suite": "linear_gelu", "case": "fwd 256x256x1024 float32", "variant": "unfused",
                "status": "ok", "ms": ms, "ms_p10": ms * 0.95, "ms_p90": ms * 1.05,
                "extra": {"role": "unfused"}}

    changes = compare.compare_rows([r(1.0)], [r(3.0)], old_machine=old, new_machine=new)
    assert not compare.regressions(changes) and "another machine" in changes[0].note
