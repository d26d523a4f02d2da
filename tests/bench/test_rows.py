"""Result rows: timings and rates from the stats, extra fields apart, tables."""

from __future__ import annotations

import pytest
from distllm.bench.rows import ROW_FIELDS, fmt, markdown_table, row, write_rows

from distllm.diagnostics.timing import stats_of


def test_row_and_table(tmp_path):
    st = stats_of([2.0, 1.0, 3.0])
    r = row("s", "c", "a", st, flops=1e9, nbytes=4e6, status="ok", note="x", device="cpu")
    assert (r["ms"], r["ms_p10"], r["ms_p90"], r["reps"]) == (2.0, st.p10_ms, st.p90_ms, 3)
    assert r["tflops"] == 1e9 / 2e-3 / 1e12 and r["gbps"] == 4e6 / 2e-3 / 1e9
    assert r["extra"] == {"note": "x", "samples_ms": [2.0, 1.0, 3.0]}  # in the order they ran
    assert r["device"] == "cpu" and set(ROW_FIELDS) <= set(r)
    gone = row("s", "c", "b", status="unavailable", reason="needs CUDA")
    assert gone["ms"] is None and gone["reason"] == "needs CUDA"
    assert "| c | a | 2 |" in markdown_table([r, gone])
    assert (fmt(None), fmt(0.12345), fmt(123.456), fmt("x")) == ("", "0.123", "123.5", "x")
    jp, cp = write_rows([r, gone], tmp_path)
    assert jp.read_text().count('"variant"') == 2 and len(cp.read_text().splitlines()) == 3


def test_results_are_written_whole_with_their_run(tmp_path, monkeypatch):
    import json
    import os

    from distllm.bench import rows as mod

    r = row("s", "c", "a", stats_of([1.0]))
    jp, _ = write_rows([r], tmp_path, run={"command": "distllm bench --quick"})
    first = jp.read_text()
    assert json.loads(first)["run"] == {"command": "distllm bench --quick"}  # one write
    # a run interrupted while writing leaves the earlier file whole, not half of the new one

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(mod.os, "replace", interrupted)
    try:
        write_rows([r, r], tmp_path)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(mod.os, "replace", os.replace)
    assert jp.read_text() == first


def test_a_write_that_fails_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch):
    """A run killed while writing keeps the earlier file whole, and a write that fails removes
    its temporary file (a ``*.tmp`` was left beside the results)."""
    from distllm.bench.rows import write_text_atomic

    from tests.bench.interrupted import Killed, half_writes

    p = tmp_path / "REPORT.md"
    p.write_text("earlier")
    half_writes(monkeypatch)
    with pytest.raises(Killed):
        write_text_atomic(p, "a newer report\n" * 10)
    monkeypatch.undo()
    assert p.read_text() == "earlier"
    assert [f.name for f in tmp_path.iterdir()] == ["REPORT.md"]


def test_reps_overrides_the_profiled_overhead_case():
    from distllm.bench.harness import BenchConfig
    from distllm.bench.train_e2e import _overhead_setup

    assert _overhead_setup(BenchConfig(quick=True), 3).reps == 5  # the paired band's minimum
    assert _overhead_setup(BenchConfig(quick=True, reps=3), 3).reps == 3  # --reps as given
