"""REPORT.md claims no more than its rows measured: a time faster than its case's ideal bound
or a hidden share above its ceiling gets no verdict, a win is nine rounds of ten counted, a
printed share lies within its printed band, and every verdict names its device."""

from __future__ import annotations

from distllm.bench import report
from distllm.bench.rows import row

from distllm.diagnostics.timing import stats_of


def _r(variant: str, samples: list[float], case: str = "c", **kw) -> dict:
    return row("s", case, variant, stats_of(samples), **kw)


def _ideal(ms: float, case: str = "c") -> dict:
    r = row("s", case, "ideal", None, role="ideal")  # a bound from medians: no repetitions
    r["ms"] = ms
    return r


def test_a_time_below_the_ideal_is_flagged_and_no_verdict_rests_on_it():
    """max(compute, comm) = 80 ms: a chunked row at 65 ms (hidden share 160%) is a wrong
    measurement; the verdict said "chunked4 wins by 1.62x over sequential — use it"."""
    seq = [100.0 + i for i in range(10)]
    fast = [60.0 + i for i in range(10)]
    rows = report.annotate([
        _r("sequential", seq, role="unfused"),
        _r("chunked4", fast, role="fused", hidden_frac=1.6, hidden_ceiling=1.0),
        _r("gemm", [80.0] * 10, role="part"),  # a part alone may be under the bound
        _ideal(80.0)])
    flags = {r["variant"]: r["extra"].get("below_ideal") for r in rows}
    assert flags == {"sequential": False, "chunked4": True, "gemm": None, "ideal": None}
    v = report.verdict(rows)
    assert "use it" not in v and "wins" not in v and "not trustworthy" in v, v
    assert "chunked4 above its hidden-share ceiling and faster than the ideal bound" in v, v
    table, summary = report.suite_table(rows), report.summary_table(rows)
    assert "| 64.5 ⚠ |" in table and report.IDEAL_NOTE in table, table
    assert "| chunked4 | 64.5 ⚠ |" in summary and report.IDEAL_NOTE in summary, summary
    # no hidden share at all: the time alone is enough to withhold the verdict
    rows = report.annotate([_r("sequential", seq, role="unfused"),
                            _r("chunked4", fast, role="fused"), _ideal(80.0)])
    assert "not trustworthy (chunked4 faster than the ideal bound)" in report.verdict(rows)
    # a baseline below the ideal: its "loss" is no verdict either
    rows = report.annotate([_r("sequential", [70.0] * 10, role="unfused"),
                            _r("chunked4", [90.0] * 10, role="fused"), _ideal(80.0)])
    v = report.verdict(rows)
    assert "keep" not in v and "(sequential faster than the ideal bound)" in v, v
    # a median just below the bound, within the row's spread (what a variant that reaches
    # the bound shows half the time): no flag, the verdict stands
    near = [72.0, 74.0, 76.0, 78.0, 79.0, 79.5, 82.0, 88.0, 92.0, 96.0]
    rows = report.annotate([_r("sequential", [110.0 + i for i in range(10)], role="unfused"),
                            _r("chunked4", near, role="fused"), _ideal(80.0)])
    assert rows[1]["ms"] < 80.0 and rows[1]["extra"]["below_ideal"] is False, rows[1]
    assert "not trustworthy" not in report.verdict(rows)
    # both above the bound: the verdict stands, no mark, no note
    rows = report.annotate([_r("sequential", seq, role="unfused"),
                            _r("chunked4", [85.0 + i for i in range(10)], role="fused"),
                            _ideal(80.0)])
    assert report.verdict(rows).startswith("chunked4 wins by 1.17x over sequential — use it")
    assert report.IDEAL_NOTE not in report.suite_table(rows) + report.summary_table(rows)


def test_a_win_is_nine_rounds_of_ten_counted():
    """Ratios [0.952, 1.25, 1.25, 1.25, 1.25]: an interpolated p10 of 1.07 read as a win in
    "nine rounds of ten"; with fewer than 10 rounds every round must be faster."""
    def case(base, fused):
        return [_r("unfused", base, role="unfused"), _r("fused", fused, role="fused")]

    for n in (5, 7, 9):
        one_slower = case([10.0] * n, [10.5] + [8.0] * (n - 1))
        assert report.verdict(one_slower).startswith("no gain here (fused 1.25x"), n
        assert report.beyond_spread(*one_slower) == 0, n
        one_faster = case([10.0] * n, [9.5] + [12.5] * (n - 1))  # the mirror: no loss
        assert report.beyond_spread(*one_faster) == 0, n
    ten = case([10.0] * 10, [10.5] + [8.0] * 9)  # 9 of 10 faster: ceil(0.9 * 10)
    assert report.verdict(ten).startswith("fused wins by 1.25x over unfused — use it")
    assert report.beyond_spread(*case([10.0] * 5, [8.0] * 5)) == 1
    assert report.beyond_spread(*case([10.0] * 5, [12.0] * 5)) == -1
    # 20 rounds, 2 slower: 18 = ceil(0.9 * 20) faster
    assert report.beyond_spread(*case([10.0] * 20, [10.5] * 2 + [8.0] * 18)) == 1
    assert report.beyond_spread(*case([10.0] * 20, [10.5] * 3 + [8.0] * 17)) == 0


def test_a_hidden_share_is_printed_within_its_band():
    """A share of the medians (96%) outside the p10..p90 of the per-round shares (97..154)."""
    r = {"hidden_frac": 0.959, "extra": {"hidden_band": [0.966, 1.544], "hidden_ceiling": 1.0}}
    assert report._hidden_cell(r) == "96% (96..154)"
    r["extra"]["hidden_band"] = [0.2, 0.5]
    assert report._hidden_cell(r) == "96% (20..96)"


def test_every_verdict_names_its_device_and_an_unused_gpu_is_said(tmp_path):
    """A --device cpu run on a machine with a GPU: the header named the GPU and no line said
    the figures were the CPU's."""
    rows = report.annotate([
        _r("unfused", [116.0 + i for i in range(10)], device="cpu", role="unfused"),
        _r("fused-auto", [93.0 + i for i in range(10)], device="cpu", role="fused")])
    machine = {"host_cpu": "AMD EPYC", "cores": 16, "gpu": "NVIDIA H100 80GB HBM3"}
    text = report.write_report(rows, machine, tmp_path).read_text()
    assert "GPU: NVIDIA H100 80GB HBM3 (unused by these rows)" in text
    assert "- `c`: on cpu: fused-auto wins by 1.24x over unfused — use it" in text, text
    assert "| on cpu: fused-auto wins by 1.24x" in report.summary_table(rows)
    for r in rows:
        r["device"] = "cuda"
    text = report.write_report(rows, machine, tmp_path).read_text()
    assert "GPU: NVIDIA H100 80GB HBM3\n" in text and "on cuda: fused-auto wins" in text
    staged = [dict(r, extra=dict(r["extra"], stage="real compute")) for r in rows]
    assert report.verdict(staged).startswith("on cuda, real compute: fused-auto wins")
