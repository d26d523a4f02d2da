"""``distllm bench``'s own options: ``--doctor`` runs the library's overlap doctor on 2 gloo
ranks and exits 1 when an overlap asked for is not happening."""

from __future__ import annotations


def test_doctor_cli_exit_code(tmp_path, capsys):
    from distllm.cli import main

    rc = main(["bench", "--doctor", "--overlap", "none", "--require-overlap", "--steps", "1",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 1, captured.out
    assert "overlap asked for but not happening" in captured.err
    md = (tmp_path / "DOCTOR.md").read_text()
    assert "**FAIL**" in md and "RowParallelLinear" in md
    assert (tmp_path / "doctor.json").is_file() and (tmp_path / "doctor_trace.json").is_file()
    assert (tmp_path / "doctor_timeline.png").read_bytes()[:4] == b"\x89PNG"
