"""``distllm bench``'s own options: ``--doctor`` runs the library's overlap doctor on 2 gloo
ranks and exits 1 when an overlap asked for is not happening; ``--model`` names GPT presets
for train_e2e's sizes and is refused, before anything runs, where it does not apply; an
``--out`` that holds an earlier run, is a file or cannot be created, and ``--shapes`` with a
dimension below 1, are refused with one line before anything runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


def _refused_before_running(args, tmp_path, capsys, monkeypatch) -> str:
    """The one error line of ``distllm bench ARGS``, which must exit 2 before any suite or
    the doctor runs, and before --out is made."""
    from distllm.bench import cli, suite

    from distllm.cli import main

    def ran(*a, **k):
        raise AssertionError("ran past the checks")

    monkeypatch.setattr(suite, "run_suites", ran)
    monkeypatch.setattr(cli, "_doctor", ran)
    assert main(["bench", "--no-progress", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distllm bench: error: "), err
    assert not (tmp_path / "o").exists()
    return err


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
    err = _refused_before_running(args, tmp_path, capsys, monkeypatch)
    assert err.startswith("distllm bench: error: --model") and says in err, err


def _refused(main, argv, capsys, says):
    """``distllm bench argv`` exits 2 with one error line that contains ``says``."""
    assert main(["bench", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distllm bench: error: "), err
    assert says in err, err
    return err


@pytest.fixture
def nothing_runs(monkeypatch):
    from distllm.bench import suite

    from distllm import testing

    def ran(*a, **k):
        raise AssertionError("ran past the checks")

    monkeypatch.setattr(suite, "run_suites", ran)
    monkeypatch.setattr(testing, "run_distributed", ran)


@pytest.mark.parametrize(("args", "record"), [
    ([], "results.json"),
    ([], "REPORT.md"),
    (["--suite", "pipeline"], "COMPARE.md"),
    (["--doctor"], "DOCTOR.md"),
    (["--doctor"], "results.json"),
    # train_e2e writes it case by case: a run killed before results.json leaves it
    (["--suite", "train_e2e"], "train_e2e_breakdown.json"),
])
def test_out_holding_an_earlier_run_is_refused(args, record, tmp_path, capsys, nothing_runs):
    from distllm.cli import main

    out = tmp_path / "b1"
    out.mkdir()
    (out / record).write_text("kept")
    (out / "linear_gelu_speedup.png").write_text("kept too")
    err = _refused(main, [*args, "--out", str(out)], capsys,
                   f"--out {out} holds the results of an earlier run ({record}): pass another "
                   "--out")
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == sorted([record, "linear_gelu_speedup.png"])
    assert (out / record).read_text() == "kept"


@pytest.mark.parametrize("doctor", [[], ["--doctor"]])
def test_out_that_is_a_file_or_cannot_be_created_is_refused(doctor, tmp_path, capsys,
                                                             nothing_runs):
    from distllm.cli import main

    f = tmp_path / "some-existing-file.txt"
    f.write_text("kept")
    _refused(main, [*doctor, "--out", str(f)], capsys,
             f"--out {f} is a file, not a folder: pass a folder as --out")
    assert f.read_text() == "kept"
    _refused(main, [*doctor, "--out", str(f / "sub")], capsys,
             f"--out {f / 'sub'}: cannot create the folder (Not a directory): pass another --out")


@pytest.mark.parametrize(("args", "says"), [
    (["--suite", "linear_gelu", "--shapes", "0,1,2"],
     "--shapes: '0,1,2' has a dimension of 0; every dimension must be at least 1"),
    (["--suite", "parallel_mlp", "--shapes", "32,16,64; 8,-4,16"],
     "'8,-4,16' has a dimension of -4"),
    (["--suite", "row_overlap", "--shapes", "64,0,64"], "'64,0,64' has a dimension of 0"),
    (["--suite", "train_e2e", "--shapes", "6,768,0,64"], "'6,768,0,64' has a dimension of 0"),
    (["--suite", "train_e2e", "--shapes", "2,256,4,32,0"], "'2,256,4,32,0' has a dimension of 0"),
    (["--suite", "linear_gelu", "--shapes", ";"], "--shapes ';': no shape given"),
    (["--suite", "linear_gelu", "--shapes", "1,2"],
     "--shapes '1,2': linear_gelu takes shapes 'M,K,N' (3 integers), not 1,2"),
    (["--suite", "row_overlap", "--shapes", "64,64,64;64,64"],
     "--shapes '64,64,64;64,64': row_overlap takes shapes 'M,K,N' (3 integers), not 64,64"),
    (["--suite", "train_e2e", "--shapes", "2,64,2"],
     "--shapes '2,64,2': train_e2e takes shapes 'L,H,B,S[,M]' (4 or 5 integers), not 2,64,2"),
    (["--suite", "linear_gelu,train_e2e", "--shapes", "64,64,64"],
     "train_e2e takes shapes 'L,H,B,S[,M]'"),
    (["--suite", "ddp,pipeline", "--shapes", "1,2"],
     "--shapes: --suite ddp,pipeline measures its own presets and takes no shapes; drop "
     "--shapes"),
    (["--suite", "", "--shapes", "1,2,3"], "--suite '' names no suite; choose from"),
    # a dimension the suite's 2 CPU ranks split: refused, not a traceback in the table
    (["--suite", "sp_overlap", "--shapes", "33,64,64"],
     "--shapes '33,64,64': sp_overlap splits M over its 2 ranks, which 33 (in 33,64,64) does "
     "not divide; choose M a multiple of 2"),
    (["--suite", "parallel_mlp", "--shapes", "8,64,64;8,64,33"],
     "parallel_mlp splits ffn over its 2 ranks, which 33 (in 8,64,33) does not divide"),
    # a shape one of train_e2e's layouts cannot run on its 2 ranks (its own check)
    (["--suite", "train_e2e", "--shapes", "1,192,2,16,1"],
     "--shapes '1,192,2,16,1': train_e2e's tp2 splits the model's heads over its 2 ranks, and "
     "H=192 (in 1,192,2,16,1) gives 3 heads (one per 64 channels); choose H a multiple of 128"),
])
def test_shapes_with_a_dimension_below_one_are_refused(args, says, tmp_path, capsys,
                                                      nothing_runs):
    from distllm.cli import main

    _refused(main, [*args, "--out", str(tmp_path / "o")], capsys, says)
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_doctor_without_cuda_prints_no_profiler_error(tmp_path):
    """Without a CUDA device kineto still asks CUDA for its devices when the trace is built,
    and logged ``gpuGetDeviceCount failed`` on every rank's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    p = subprocess.run([sys.executable, "-m", "distllm", "bench", "--doctor", "--steps", "1",
                        "--out", str(tmp_path / "d")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Overlap doctor" in p.stdout
    assert "gpuGetDeviceCount" not in p.stderr and "ERROR:" not in p.stderr, p.stderr


_PROFILE_ONCE = """
import torch
from torch.profiler import ProfilerActivity
from distllm.diagnostics.profiler import profile
torch.cuda.is_available = lambda: {cuda}
with profile(activities=[ProfilerActivity.CPU]):
    torch.ones(3) + 1
"""


@pytest.mark.parametrize("level,cuda,quiet", [(None, False, True), ("0", False, False),
                                              (None, True, False)])
def test_the_profiler_is_quiet_without_cuda_unless_the_user_sets_a_level(level, cuda, quiet):
    """distllm's profiles (doctor, timeline, the bench suites) leave kineto's log off on a
    machine without CUDA; a KINETO_LOG_LEVEL the user set is kept, and so is kineto's log
    where CUDA is (there it also prints its start/stop lines)."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    if level is not None:
        env["KINETO_LOG_LEVEL"] = level
    p = subprocess.run([sys.executable, "-c", _PROFILE_ONCE.format(cuda=cuda)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # kineto's log lines: "LEVEL:date time pid:tid file:line] ..." (INFO lines on torch 2.11,
    # USDT and ERROR on 2.14)
    loud = re.search(r"^\s*(INFO|WARNING|ERROR|USDT|STAGE):\d{4}-\d\d-\d\d ", p.stderr, re.M)
    assert (loud is None) == quiet, p.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--doctor", "--compare", "OLD", "--fail-on-regression"],
     "--compare: --doctor takes none (it profiles its own small model on 2 CPU ranks and "
     "writes no results.json); drop --compare, or --doctor"),
    (["--doctor", "--suite", "ddp"], "--suite: --doctor takes none"),
    (["--doctor", "--dtype", "bf16"], "--dtype: --doctor takes none"),
    (["--doctor", "--reps", "2"], "--reps: --doctor takes none"),
    (["--doctor", "--quick"], "--quick: --doctor takes none"),
    (["--suite", "linear_gelu", "--steps", "9"],
     "--steps only applies with --doctor: add --doctor, or drop --steps"),
    (["--overlap", "none"], "--overlap only applies with --doctor"),
    (["--no-require-overlap"], "--require-overlap only applies with --doctor"),
    (["--compare", "OLD", "--tolerance", "-1"],
     "--tolerance -1.0: give a relative margin >= 0 (0.05 is 5%)"),
    (["--compare", "OLD", "--tolerance", "nan"], "--tolerance nan: give a relative margin"),
    (["--tolerance", "0.1"], "--tolerance is the margin of --compare OLD_DIR: add --compare, "
                             "or drop --tolerance"),
])
def test_a_flag_of_the_other_mode_is_refused_with_one_line(args, says, tmp_path, capsys,
                                                            monkeypatch):
    """--doctor took and ignored the suites' flags (--doctor --compare OLD
    --fail-on-regression could never fail), and a suites run the doctor's; --tolerance was
    taken out of range, and without --compare."""
    err = _refused_before_running(args, tmp_path, capsys, monkeypatch)
    assert says in err, err



def test_a_run_that_measured_nothing_fails(monkeypatch, tmp_path, capsys):
    """Every case unavailable (shapes the ranks cannot split, memory they cannot get): the
    report is written, and the exit code says the run did not measure anything."""
    import types

    from distllm.bench import suite
    from distllm.bench.rows import row

    from distllm.cli import main

    def unavailable(names, cfg, progress=True):
        return types.SimpleNamespace(elapsed_s={"linear_gelu": 0.1}, rows=[
            row("linear_gelu", "fwd 8x8x8", v, status="unavailable", reason="no memory")
            for v in ("unfused", "fused")])

    monkeypatch.setattr(suite, "run_suites", unavailable)
    out = tmp_path / "b"
    assert main(["bench", "--suite", "linear_gelu", "--no-progress", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "distllm bench: nothing was measured (2 rows, none ok; the first says: no memory)" in err
    assert (out / "REPORT.md").is_file()


def _atomic_writes(monkeypatch) -> list[str]:
    """The names of the files written through ``write_text_atomic`` from now on (each still
    written, by the real function)."""
    from distllm.bench import rows

    names, real = [], rows.write_text_atomic

    def recorded(path, text):
        names.append(os.path.basename(path))
        return real(path, text)

    monkeypatch.setattr(rows, "write_text_atomic", recorded)
    return names


def test_doctor_files_are_written_whole(tmp_path, monkeypatch, capsys):
    """doctor.json and DOCTOR.md go through a temporary file renamed over the result, as
    results.json does: a run stopped while writing leaves no half file (the ranks are
    stand-ins here: what is tested is the writing)."""
    import json

    from distllm.bench import plots

    from distllm import testing
    from distllm.cli import main

    names = _atomic_writes(monkeypatch)
    res = [{"report": {"ok": True, "timeline": [], "rank": r}, "markdown": "| layer |"}
           for r in range(2)]
    monkeypatch.setattr(testing, "run_distributed", lambda *a, **k: res)
    monkeypatch.setattr(plots, "plot_events", lambda *a, **k: None)
    out = tmp_path / "d"
    assert main(["bench", "--doctor", "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(names) == ["DOCTOR.md", "doctor.json"]
    reports = json.loads((out / "doctor.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1] and reports[0]["trace"] == "doctor_trace.json"
    assert (out / "DOCTOR.md").read_text().endswith("(doctor_timeline.png)\n")
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_compare_md_is_written_whole(tmp_path, monkeypatch, capsys):
    import json

    from distllm.bench import suite
    from distllm.bench.rows import machine_info

    from distllm.cli import main

    monkeypatch.setattr(suite, "SUITES", {
        "fake": suite.Suite("fake", "tests.bench.fake_suites", "synthetic", shape="M,K,N",
                            shape_dims=(3,))})
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps({"machine": machine_info(), "rows": []}))
    names = _atomic_writes(monkeypatch)
    out = tmp_path / "new"
    rc = main(["bench", "--suite", "fake", "--shapes", "1,2,3", "--reps", "1", "--no-progress",
               "--out", str(out), "--compare", str(old)])
    assert rc == 0, capsys.readouterr().err
    assert "COMPARE.md" in names
    text = (out / "COMPARE.md").read_text()  # whole: from its title to the last table's end
    assert text.startswith(f"# Changes against {old}\n") and text.endswith(
        "| suite | case | old winner | new winner | agreement |\n|---|---|---|---|---|\n")
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_the_readmes_bench_commands_run_as_quoted():
    """The README quotes the command behind each of its results (inline, not in the bash
    blocks tests/test_readme.py runs); an ``--out`` naming the folder those results are in
    is refused ("holds the results of an earlier run"), so none may name one."""
    import shlex
    from pathlib import Path

    from distllm.bench.cli import _RECORDS

    root = Path(__file__).resolve().parents[2]
    quoted = [" ".join(m.split()) for m in
              re.findall(r"`(distllm bench [^`]*)`", (root / "README.md").read_text())]
    assert len(quoted) >= 10, quoted  # the sections' commands are found
    for cmd in quoted:
        argv = shlex.split(cmd)[2:]
        out = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"), None)
        if out is not None:
            held = [f for f in _RECORDS if (root / out / f).exists()]
            assert not held, f"`{cmd}` is refused as written: {out} holds {held}"
