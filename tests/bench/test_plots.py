"""The speed-up plot: bars per case, each labelled in its own unit."""

from __future__ import annotations

from distllm.bench import plots


def _row(case: str, variant: str, ms: float, role: str) -> dict:
    return {"suite": "s", "case": case, "variant": variant, "ms": ms, "ms_p10": ms * 0.9,
            "ms_p90": ms * 1.1, "status": "ok", "extra": {"role": role}}


def _labels(monkeypatch, rows: list[dict], tmp_path) -> list[str]:
    """The texts written on the bars of ``rows``'s plot."""
    said = []
    real = plots._bars

    def spy(ax, series, *a):
        real(ax, series, *a)
        said.extend(t.get_text() for t in ax.texts)

    monkeypatch.setattr(plots, "_bars", spy)
    assert plots.plot_speedup(rows, "s", tmp_path) == tmp_path / "s_speedup.png"
    return said


def test_a_time_plot_labels_milliseconds_and_a_speedup_plot_ratios(monkeypatch, tmp_path):
    """With no baseline the plot shows time per case: its bars were labelled "194.18x"."""
    timed = [_row("a", "distllm", 194.18, "fused"), _row("b", "distllm", 64.7, "fused")]
    said = _labels(monkeypatch, timed, tmp_path)
    assert said == ["194 ms", "64.7 ms"], said
    ratio = [_row("a", "unfused", 30.0, "unfused"), _row("a", "fused", 20.0, "fused")]
    said = _labels(monkeypatch, ratio, tmp_path)
    assert "1.50x" in said and all(t.endswith("x") for t in said), said


def test_a_case_without_its_baseline_says_so():
    # a suite with unfused rows, where one case's unfused variant failed: its slot is empty,
    # and its label says why instead of looking like a case with nothing to show
    failed = {**_row("b", "unfused", 1.0, "unfused"), "status": "error", "ms": None}
    rows = [_row("a", "unfused", 30.0, "unfused"), _row("a", "fused", 20.0, "fused"),
            failed, _row("b", "fused", 10.0, "fused")]
    labels, series, over = plots._speedup_series(rows)
    assert labels == ["a", "b\n(no unfused row)"] and over == "unfused"
    assert series == {"fused": [(0, *plots.speedup_band(rows[0], rows[1]))]}
