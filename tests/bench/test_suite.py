"""`distllm bench`: a --quick run on tiny shapes, checking the structure of every output file.

The registry is replaced by a synthetic fast suite (tests/bench/fake_suites.py), a module
whose setup() raises, a module that does not exist, and the real linear_gelu suite on a tiny
shape, so that the run stays well under a minute on 2 shared cores.
"""

from __future__ import annotations

import csv
import json
import sys
import types

import pytest
from distllm.bench import report, suite
from distllm.bench.harness import BenchConfig, Case, Setup
from distllm.bench.rows import ROW_FIELDS, row

from distllm.cli import main
from distllm.diagnostics.timing import stats_of

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _broken_setup(cfg: BenchConfig, case: Case) -> Setup:
    raise RuntimeError("synthetic failure inside setup()")


def _suite_module(name: str, setup, rows) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.SUITE, mod.setup, mod.rows = name, setup, rows
    mod.cases = lambda cfg: [Case("c")]
    return mod


@pytest.fixture
def registry(monkeypatch):
    broken = _suite_module("fake_broken_suite", _broken_setup, lambda cfg, case, res: [])
    monkeypatch.setitem(sys.modules, "fake_broken_suite", broken)
    reg = {
        "fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic", overlap=True,
                            shape="M,K,N", shape_dims=(3,)),
        "broken": suite.Suite("broken", "fake_broken_suite", "raises"),
        "missing": suite.Suite("missing", "distllm.bench.no_such_suite", "absent"),
        "linear_gelu": suite.SUITES["linear_gelu"],
    }
    monkeypatch.setattr(suite, "SUITES", reg)
    return reg


def _check_json(path, suites):
    data = json.loads(path.read_text())
    assert {"time", "torch", "git", "cores", "host_cpu"} <= set(data["machine"])
    assert data["run"]["suites"] == suites
    assert set(data["run"]["elapsed_s"]) >= {"fake", "linear_gelu"}
    rows = data["rows"]
    assert rows and all(set(ROW_FIELDS) <= set(r) for r in rows)
    assert list(dict.fromkeys(r["suite"] for r in rows)) == suites  # none dropped, in order
    for r in rows:
        assert r["status"] in ("ok", "unavailable", "error"), r
        if r["status"] == "ok":
            assert r["ms_p10"] <= r["ms"] <= r["ms_p90"] and r["reps"] >= 1
        else:
            assert r["reason"], r
    return rows


def _check_csv(path, n_rows):
    with path.open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == n_rows
    assert set(ROW_FIELDS) | {"time", "torch", "git"} <= set(got[0])


def test_quick_run_writes_every_file(registry, tmp_path, capsys):
    out = tmp_path / "run1"
    rc = main(["bench", "--quick", "--shapes", "16,32,24", "--reps", "3", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    names = ["fake", "broken", "missing", "linear_gelu"]
    rows = _check_json(out / "results.json", names)
    _check_csv(out / "results.csv", len(rows))

    fake = {r["variant"]: r for r in rows if r["suite"] == "fake"}
    assert fake["fused"]["speedup_vs_unfused"] == pytest.approx(
        fake["unfused"]["ms"] / fake["fused"]["ms"])
    assert fake["fused"]["extra"]["speedup_vs_peer"] > 1 and fake["fused"]["tflops"] > 0
    assert fake["fused_cuda"]["status"] == "unavailable"
    assert [r["status"] for r in rows if r["suite"] == "broken"] == ["error"]
    assert "synthetic failure" in next(r for r in rows if r["suite"] == "broken")["reason"]
    missing = next(r for r in rows if r["suite"] == "missing")
    assert missing["status"] == "unavailable" and "no_such_suite" in missing["reason"]
    lg = [r for r in rows if r["suite"] == "linear_gelu"]
    assert any(r["status"] == "ok" for r in lg), lg  # the real suite ran on the tiny shape

    md = (out / "REPORT.md").read_text()
    for n in names:
        assert f"## {n}" in md
    # 3 repetitions: too few for paired bands, and the header says which bands those are
    assert ("; where a variant ran fewer than 5 repetitions (as here: --quick, or a low "
            "--reps), the widest ratio of the two p10..p90 bands;") in md
    assert "fused wins by" in md and "use it" in md  # 2 ms against 20 ms: beyond any spread
    assert "ahead of torch_peer" in md
    assert "## Summary" in md and "| fake | 16,32,24 | " in md
    assert "needs a CUDA device" in md and "synthetic failure" in md
    assert "_broken_setup" in md  # the error row says where it was raised
    for png in ["fake_speedup.png", "fake_timeline.png", "linear_gelu_speedup.png"]:
        assert (out / png).read_bytes()[:8] == PNG_MAGIC, png
        assert f"]({png})" in md
    stdout = capsys.readouterr().out
    assert "| case | variant |" in stdout and "fused wins by" in stdout

    # the fake suite again, against the first run (a margin of 400% absorbs machine load:
    # under a loaded CI machine, 100% once failed on the 2 ms sleeps of this synthetic suite)
    rc = main(["bench", "--quick", "--suite", "fake", "--shapes", "16,32,24", "--reps", "3",
               "--out", str(tmp_path / "run2"), "--compare", str(out), "--tolerance", "4",
               "--fail-on-regression"])  # with the progress bar
    cmp_md = (tmp_path / "run2" / "COMPARE.md").read_text()
    assert "| fake | 16,32,24 | fused |" in cmp_md and "| fake | 16,32,24 | fused | fused |" \
        in cmp_md  # the row compared, and the winner table
    assert "Load average (start / end): old " in cmp_md
    captured = capsys.readouterr()
    assert "regression(s) beyond the measured spread" in captured.out
    assert "bench" in captured.err and "fake" in captured.err  # the bar went to stderr
    assert rc == 0, cmp_md


def test_a_second_run_into_the_same_out_is_refused(registry, tmp_path, capsys):
    """The first run's files stay as they were: nothing replaced, nothing added beside them."""
    out = tmp_path / "b1"
    args = ["--shapes", "16,32,24", "--reps", "3", "--no-progress", "--out", str(out)]
    assert main(["bench", "--suite", "fake", *args]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"results.json", "REPORT.md", "fake_speedup.png"} <= set(first)
    capsys.readouterr()
    assert main(["bench", "--suite", "fake", *args]) == 2
    err = capsys.readouterr().err
    assert err == (f"distllm bench: error: --out {out} holds the results of an earlier run "
                   "(results.json, results.csv, REPORT.md): pass another --out\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_list_and_bad_input(registry, capsys, tmp_path):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "fake" in out and "UNAVAILABLE" in out and "no_such_suite" in out
    bad = [["--suite", "nope"], ["--shapes", "1,x,3"], ["--dtype", "int3"],
           ["--fail-on-regression"], ["--compare", str(tmp_path / "absent"), "--suite", "fake"],
           ["--net", "fast"]]
    for args in bad:
        assert main(["bench", "--out", str(tmp_path / "bad"), "--no-progress", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err, (args, err)
        assert err.count("--net") <= 1, err  # the flag named once, not twice over


def _r(variant, ms, spread=0.05, case="c", **kw):
    st = stats_of([ms * (1 - spread), ms, ms * (1 + spread)])
    return row("s", case, variant, st, **kw)


def test_roles_and_verdicts():
    assert [report.role_of({"variant": v}) for v in
            ["fused", "unfused", "sequential", "overlap_chunks4", "torch_ddp", "ideal",
             "gemm-only", "peer-onednn-postop", "distllm_ddp", "no-overlap", "fused-auto",
             "-"]] == \
        ["fused", "unfused", "unfused", "fused", "peer", "ideal", "part", "peer", "fused",
         "unfused", "fused", "-"]
    assert report.role_of({"variant": "x", "extra": {"role": "peer"}}) == "peer"
    win = report.annotate([_r("unfused", 13.1), _r("fused", 10.0), _r("torch", 12.0)])
    assert report.verdict(win).startswith(
        "fused wins by 1.31x over unfused — use it; ahead of torch")
    lose = [_r("sequential", 10.0), _r("chunked4", 12.0)]
    assert report.verdict(lose) == \
        "chunked4 loses (0.83x, 1.20x slower than sequential) — keep sequential"
    tie = [_r("unfused", 10.0, 0.2), _r("fused", 9.8, 0.2), _r("auto", 10.0, 0.2)]
    assert report.verdict(tie).startswith("no gain here (fused 1.02x, within the spread)")
    assert "auto runs at 1.00x of unfused" in report.verdict(tie)
    assert "against itself" not in report.verdict(tie)
    # an A/A control (the baseline again, elsewhere in the round) is quoted, never a contender
    ctl = _r("unfused_again", 9.0, 0.2, role="control")
    assert report.verdict([*tie, ctl]).endswith(
        "auto runs at 1.00x of unfused (unfused against itself: 1.11x)")
    assert report.verdict([ctl, _r("a", 10.0), _r("b", 12.0)]).startswith("fastest: a (1.20x")
    sched = [_r("gpipe", 10.0), _r("1f1b", 8.0)]
    assert report.verdict(sched).startswith("fastest: 1f1b (1.25x over gpipe")
    gone = [row("s", "c", "fused", status="unavailable", reason="needs CUDA")]
    assert report.verdict(gone) == "not measured here: needs CUDA"


def _drifting(variant, scale, drift):
    """A row whose repetition i took ``scale * drift[i]`` ms (the machine's drift)."""
    return row("s", "c", variant, stats_of([scale * d for d in drift]))


def test_speedup_band_pairs_the_repetitions_of_one_round():
    """Interleaved variants share each round's drift: the band of the per-round ratios sees
    a steady 10% gain that the two p10..p90 bands (each as wide as the drift) hide; rows of
    unequal length (a dropped variant, two runs) fall back to the unpaired band."""
    drift = [1.0, 1.3, 0.9, 1.2, 0.8, 1.1, 1.25, 0.95]
    base, fused = _drifting("unfused", 11.0, drift), _drifting("fused", 10.0, drift)
    assert base["extra"]["samples_ms"] == pytest.approx([11.0 * d for d in drift])  # as run
    lo, mid, hi = report.speedup_band(base, fused)
    assert (lo, mid, hi) == pytest.approx((1.1, 1.1, 1.1))
    assert report.verdict(report.annotate([base, fused])).startswith("fused wins by 1.10x")
    # the same medians with the drift reversed in one of them: rounds disagree, no win
    anti = _drifting("fused", 10.0, drift[::-1])
    lo, mid, hi = report.speedup_band(base, anti)
    assert mid == pytest.approx(1.1) and lo < 0.9 and hi > 1.3, (lo, hi)
    assert "within the spread" in report.verdict(report.annotate([base, anti]))
    short = _drifting("fused", 10.0, drift[:-1])  # unpaired: p10/p90 of each
    assert report.speedup_band(base, short) == pytest.approx(
        (base["ms_p10"] / short["ms_p90"], base["ms"] / short["ms"],
         base["ms_p90"] / short["ms_p10"]))


def test_hidden_above_its_ceiling_is_flagged(tmp_path):
    """Synthetic rows: a hidden share above its ceiling (1 unless the row says otherwise) is
    flagged in the rows (results.json) and marked in both REPORT.md tables."""
    rows = report.annotate([
        _r("sequential", 10.0),
        _r("chunked2", 7.0, hidden_frac=0.60, hidden_ceiling=1.0),  # fine
        _r("chunked4", 6.0, hidden_frac=1.14, hidden_ceiling=1.0),  # impossible: flagged
        _r("auto", 6.5, hidden_frac=0.95),  # no ceiling given: 1
        _r("chunked8", 8.0, hidden_frac=0.40, hidden_ceiling=0.3),  # above its own ceiling
        _r("gemm", 5.0),  # a part: no hidden share, no flag
        _r("sequential", 10.0, case="d"), _r("chunked4", 8.0, case="d", hidden_frac=1.0),
    ])
    flags = {(r["case"], r["variant"]): r["extra"].get("above_ceiling") for r in rows}
    assert flags == {("c", "sequential"): None, ("c", "chunked2"): False,
                     ("c", "chunked4"): True, ("c", "auto"): False, ("c", "chunked8"): True,
                     ("c", "gemm"): None, ("d", "sequential"): None,
                     ("d", "chunked4"): False}, flags  # exactly at the ceiling: possible
    table = report.suite_table(rows)
    assert "| 114% ⚠ |" in table and "| 60% |" in table and "| 40% ⚠ |" in table
    assert report.CEILING_NOTE in table
    summary = report.summary_table(rows)  # the best fused of case c is chunked4: flagged
    assert "| chunked4 | 6 | " in summary and "| 114% ⚠ |" in summary, summary
    assert report.CEILING_NOTE in summary
    clean = report.annotate([_r("sequential", 10.0), _r("chunked2", 7.0, hidden_frac=0.6)])
    assert report.CEILING_NOTE not in report.suite_table(clean) + report.summary_table(clean)


def test_verdict_names_the_stage_and_advises_only_on_real_compute():
    sleep = [_r("1f1b", 226.0, stage="fixed-duration (sleep) stages", synthetic=True,
                role="unfused"),  # the pipeline suite's baseline
             _r("zb-h1", 163.9, stage="fixed-duration (sleep) stages", synthetic=True)]
    v = report.verdict(report.annotate(sleep))
    assert v.startswith("on fixed-duration (sleep) stages: zb-h1 wins by 1.38x over 1f1b"), v
    assert "use it" not in v and "not a recommendation" in v, v
    real = [_r("1f1b", 104.1, stage="real compute (MLP blocks)", role="unfused"),
            _r("zb-h1", 126.0, stage="real compute (MLP blocks)")]
    v = report.verdict(report.annotate(real))
    assert v == ("on real compute (MLP blocks): zb-h1 loses (0.83x, 1.21x slower than 1f1b) "
                 "— keep 1f1b"), v


def test_registry_names_every_suite_and_its_module_imports():
    from pathlib import Path

    from distllm.bench import harness

    assert list(suite.SUITES) == ["linear_gelu", "parallel_mlp", "row_overlap", "sp_overlap",
                                  "ddp", "zero", "pipeline", "train_e2e", "plan_validation"]
    avail = {n: (ok, why) for n, ok, why in suite.availability()}
    here = Path(harness.__file__).parent
    for name, s in suite.SUITES.items():  # every registered suite ships and runs
        path = here / f"{s.module.rsplit('.', 1)[1]}.py"
        assert path.is_file(), f"suite {name!r} is registered but {path} does not exist"
        assert avail[name][0], f"suite {name!r} cannot run: {avail[name][1]}"
    # a module that is missing is listed with its reason, not dropped
    [(name, ok, why)] = suite.availability({"gone": suite.Suite("gone", "distllm.bench.nope", "t")})
    assert name == "gone" and not ok and "cannot be imported" in why, why
    # a module without the runner's contract is not a suite, and says what it lacks
    [(_, ok, why)] = suite.availability({"h": suite.Suite("h", "distllm.bench.harness", "t")})
    assert not ok and "lacks cases, setup, rows, SUITE" in why, why
    assert suite.parse_suites("zero,ddp") == ["ddp", "zero"]


def _two_suite_rows(cfg: BenchConfig, case: Case, result) -> list[dict]:
    st = stats_of([1.0, 1.1, 1.2])
    return [row("sub", "c", "x", st), row("", "c", "unfused", st), row("other", "c", "y", st),
            row("main", "c", "fused", st)]


def test_rows_keep_sub_suites_and_registered_names_are_reassigned(monkeypatch):
    mod = _suite_module("fake_two_suites", lambda cfg, case: Setup(), _two_suite_rows)
    monkeypatch.setitem(sys.modules, "fake_two_suites", mod)
    reg = {"main": suite.Suite("main", "fake_two_suites", "t"),
           "other": suite.Suite("other", "distllm.bench.no_such_suite", "t")}
    res = suite.run_suites(["main", "other"], BenchConfig(), progress=False, registry=reg)
    got = [(r["suite"], r["variant"], r["status"]) for r in res.rows]
    # main's rows first (a row naming 'other', a registered suite not run by this module,
    # belongs to main), then main's own sub-suite, then the unavailable suite
    assert got == [("main", "unfused", "ok"), ("main", "y", "ok"), ("main", "fused", "ok"),
                   ("sub", "x", "ok"), ("other", "-", "unavailable")]
    assert set(res.elapsed_s) == {"main"}


def test_hidden_below_its_floor_is_flagged():
    """A share has no floor unless its module sets one (a schedule may be slower than its
    parts in a row by more than all of what could hide: a result, not an error); below a
    floor the row sets, or from parts that do not add up, it gets the ceiling's mark and its
    own note in both tables."""
    rows = report.annotate([
        _r("sequential", 10.0),
        _r("chunked2", 12.0, hidden_frac=-1.08),  # no floor: a result
        _r("chunked4", 11.0, hidden_frac=-1.0, parts_add_up=False),  # parts do not add up
        _r("chunked8", 10.5, hidden_frac=-0.2, hidden_floor=0.0),  # below its own floor
        _r("gemm", 5.0),
    ])
    flags = {r["variant"]: r["extra"].get("below_floor") for r in rows}
    assert flags == {"sequential": None, "chunked2": False, "chunked4": True,
                     "chunked8": True, "gemm": None}
    assert {r["variant"]: r["extra"].get("above_ceiling") for r in rows}["chunked2"] is False
    table = report.suite_table(rows)
    assert "| -108% |" in table and "| -100% ⚠ |" in table and "| -20% ⚠ |" in table
    assert report.FLOOR_NOTE in table and report.CEILING_NOTE not in table
    best = report.annotate([_r("sequential", 10.0),
                            _r("chunked2", 12.0, hidden_frac=-1.5, hidden_floor=-1.0)])
    summary = report.summary_table(best)
    assert "| -150% ⚠ |" in summary and report.FLOOR_NOTE in summary


def test_a_failed_case_is_named_and_has_a_summary_line():
    """One case that raised (its error row: variant "-", case = its label) is that case in
    "not measured", not the whole suite, and keeps a Summary line with its reason; a suite
    that failed as a whole (case "-") is the whole suite."""
    st = stats_of([29.0, 30.0, 31.0])
    rows = report.annotate([
        row("row", "fwd 8 loopback", "sequential", st), row("row", "fwd 8 loopback", "chunked4",
                                                            stats_of([19.0, 20.0, 21.0])),
        row("row", "bwd 8", "-", status="error", reason="RuntimeError: boom"),
        row("row", "-", "-", status="unavailable", reason="no CUDA device"),
        row("row", "pp 8", "gpipe", st)])
    assert report.not_measured(rows) == ["- case `bwd 8`: error: RuntimeError: boom",
                                         "- the whole suite: unavailable: no CUDA device"]
    lines = report.summary_table(rows).splitlines()[2:]
    assert [ln.split(" | ")[1] for ln in lines] == ["fwd 8 loopback", "bwd 8", "-", "pp 8"]
    assert lines[1] == "| row | bwd 8 |  | - |  |  |  | not measured here: RuntimeError: boom |"
    assert lines[2].endswith("| not measured here: no CUDA device |")
    assert lines[3].endswith("| measured: gpipe only (no unfused baseline in this case) |")


def test_a_failed_case_of_a_shared_module_fails_its_own_suite(monkeypatch):
    """ddp and zero share a module: the zero case raising gave an error row to both suites,
    and the ddp section listed it among what it did not measure."""
    def setup(cfg, case):
        if case.params["boom"]:
            raise RuntimeError("zero phase failed")
        return Setup({"a": lambda: None}, warmup=0, reps=3)

    mod = _suite_module("fake_shared", setup, lambda cfg, case, res: [
        row("ddp", case.label, n, s) for n, s in res.stats.items()])
    mod.cases = lambda cfg: [Case("ddp", {"boom": False}, suite="ddp"),
                             Case("zero", {"boom": True}, suite="zero")]
    monkeypatch.setitem(sys.modules, "fake_shared", mod)
    reg = {"ddp": suite.Suite("ddp", "fake_shared", "t"),
           "zero": suite.Suite("zero", "fake_shared", "t")}
    res = suite.run_suites(["ddp", "zero"], BenchConfig(), progress=False, registry=reg)
    errors = [(r["suite"], r["case"]) for r in res.rows if r["status"] == "error"]
    assert errors == [("zero", "zero")], res.rows
    assert [r["variant"] for r in res.rows if r["suite"] == "ddp"] == ["a"]


def test_a_ranks_failure_is_its_exception_not_its_traceback(monkeypatch):
    """A case whose rank raised: the row names the rank and its exception, raised where the
    rank's traceback ends, not the traceback flattened into a table cell."""
    from distllm.testing import run_distributed

    def setup(cfg, case):
        run_distributed(_raise_in_rank, world_size=2)

    mod = _suite_module("fake_ranks", setup, lambda cfg, case, res: [])
    monkeypatch.setitem(sys.modules, "fake_ranks", mod)
    reg = {"ranks": suite.Suite("ranks", "fake_ranks", "t")}
    (r,) = suite.run_suites(["ranks"], BenchConfig(), progress=False, registry=reg).rows
    assert r["status"] == "error" and "Traceback" not in r["reason"], r["reason"]
    assert r["reason"].startswith("DistributedFailure: _raise_in_rank: rank 0 of 2 failed: "
                                  "ValueError: shape 33 is odd (File "), r["reason"]
    assert "in _raise_in_rank)" in r["reason"]


def _raise_in_rank():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("shape 33 is odd")
    dist.barrier()


def test_suites_sharing_a_module_get_the_time_of_their_own_cases(monkeypatch):
    """Two suites of one module (as ddp and zero): each suite's seconds are those of its own
    cases (on a clock that setup() advances), not the module's total split evenly; a case
    that names no suite counts to the suite of its rows."""
    clock = [0.0]
    monkeypatch.setattr(suite, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def setup(cfg, case):
        clock[0] += case.params["s"]
        return Setup()

    mod = _suite_module("fake_shared", setup,
                        lambda cfg, case, res: [row(case.params["to"], case.label, "x")])
    mod.cases = lambda cfg: [Case("f", {"s": 0.05, "to": "fast"}, suite="fast"),
                             Case("z", {"s": 1.0, "to": "slow"}, suite="slow"),
                             Case("y", {"s": 0.5, "to": "slow"})]
    monkeypatch.setitem(sys.modules, "fake_shared", mod)
    reg = {"fast": suite.Suite("fast", "fake_shared", "t"),
           "slow": suite.Suite("slow", "fake_shared", "t")}
    res = suite.run_suites(["fast", "slow"], BenchConfig(), progress=False, registry=reg)
    assert res.elapsed_s == pytest.approx({"fast": 0.05, "slow": 1.5})


def test_the_report_says_its_bands_are_paired_only_where_they_are():
    """The header called every band paired; with fewer than 5 repetitions a band is the
    widest ratio of the two rows' p10..p90 (speedup_band)."""
    from distllm.bench import report

    def r(n: int) -> dict:
        return {"status": "ok", "ms": 1.0, "extra": {"role": "fused",
                                                      "samples_ms": [1.0] * n}}

    assert report._unpaired([r(5), r(3)]) and not report._unpaired([r(5), r(7)])
    assert not any("fewer than" in x for x in report._header({}, {}, False))

