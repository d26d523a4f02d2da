"""Result rows: timings and rates from the stats, extra fields apart, tables."""

from __future__ import annotations

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
