"""``distllm bench``'s own options: ``--doctor`` runs the library's overlap doctor on 2 gloo
ranks and exits 1 when an overlap asked for is not happening; ``--model`` names GPT presets
for train_e2e's sizes and is refused, before anything runs, where it does not apply."""

from __future__ import annotations

import pytest


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


def test_model_goes_to_train_e2e(monkeypatch, tmp_path):
    from distllm.bench import suite, train_e2e

    from distllm.cli import main

    seen = {}

    class Ran(Exception):
        pass

    def fake_run(names, cfg, progress=True):  # record what would run, run nothing
        seen.update(names=names, cfg=cfg)
        raise Ran

    monkeypatch.setattr(suite, "run_suites", fake_run)
    with pytest.raises(Ran):
        main(["bench", "--suite", "train_e2e", "--model", "tiny, gpt2-small", "--no-progress",
              "--out", str(tmp_path)])
    assert seen["names"] == ["train_e2e"] and seen["cfg"].extra["model"] == ["tiny", "gpt2-small"]
    cases = train_e2e.cases(seen["cfg"])  # the sizes the suite would run
    firsts = cases[::len(train_e2e.LAYOUTS)][:2]  # each size's first layout
    assert [c.params["shape"] for c in firsts] == [(4, 128, 16, 128, 4), (12, 768, 8, 64, 4)]


@pytest.mark.parametrize(("args", "says"), [
    (["--suite", "train_e2e", "--model", "gpt2-small-6"],
     "--model 'gpt2-small-6': unknown GPT preset(s) gpt2-small-6; choose from tiny, gpt2-small"),
    (["--suite", "train_e2e", "--model", ","], "--model ',': no GPT preset named"),
    (["--suite", "train_e2e", "--model", "tiny", "--shapes", "4,128,16,128"],
     "--model and --shapes both set train_e2e's model sizes"),
    (["--suite", "train_e2e,pipeline", "--model", "tiny"],
     "--model sets the model sizes of train_e2e only, and --suite train_e2e,pipeline also "
     "runs pipeline"),
    (["--model", "tiny"], "--suite all also runs linear_gelu"),
    (["--doctor", "--suite", "train_e2e", "--model", "tiny"], "--doctor does not take it"),
])
def test_model_refused_with_one_line(args, says, tmp_path, capsys, monkeypatch):
    from distllm.bench import cli, suite

    from distllm.cli import main

    def ran(*a, **k):
        raise AssertionError("ran past the checks")

    monkeypatch.setattr(suite, "run_suites", ran)
    monkeypatch.setattr(cli, "_doctor", ran)
    assert main(["bench", "--no-progress", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distllm bench: error: --model"), err
    assert says in err, err
    assert not (tmp_path / "o").exists()  # refused before anything ran
