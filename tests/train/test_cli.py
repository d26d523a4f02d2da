"""``distllm train`` bad input: one clear line on stderr and exit code 2, checked before any
rank starts where it can be (and a checkpoint of another model refused at --resume); what only
a rank finds under ``--nproc`` is reported once the same way; a failed rank, or a signal to
the launcher, ends the job with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distllm.cli import main
from distllm.testing import run_distributed
from distllm.train import checkpoint
from tests.train._util import train_many


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _err(capsys, argv: list[str]) -> str:
    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("distllm train: error: ")
    return err[0]


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "4", "--tp", "3"], "does not divide the world size 4"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--dp", "2"], "does not match the world size"),
    (["--nproc", "100000"], "cores"),
    (["--nproc", "2", "--dp", "2", "--global-batch", "7"], "--global-batch"),
    (["--nproc", "2", "--pp", "2", "--micro-batches", "1", "--schedule", "1f1b"],
     "--micro-batches"),
    (["--nproc", "2", "--data", "/nonexistent/corpus.txt"], "no such file"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33"], "--seq-len"),
    (["--seq-len", "4096"], "exceeds"),
    (["--lr", "-1"], "--lr -1.0: it must be a positive finite number"),
    (["--pp", "2", "--schedule", "zb-h1", "--activation-checkpointing", "full"], "zb-h1"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "1"],
     "raise --virtual-stages to >= 2, or use schedule '1f1b'"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved-1f1b", "--micro-batches", "3"],
     "interleaved-1f1b needs --micro-batches to be a multiple of pp=2 (got 3)"),
    (["--nproc", "2", "--pp", "2", "--schedule", "zb-h1", "--zero", "3"], "--zero 2 or lower"),
    (["--nproc", "2", "--bucket-cap-mb", "0"],
     "--bucket-cap-mb 0.0: it must be a finite size > 0 MiB"),
    (["--nproc", "2", "--timeout", "inf"], "--timeout inf: it must be at least 1 s"),
    (["--nproc", "2", "--weight-decay", "nan"], "--weight-decay nan: it must be finite"),
    (["--nproc", "2", "--seed", "99999999999999"], "--seed 99999999999999: choose a seed"),
    (["--nproc", "2", "--eps", "-1"], "--eps -1.0: it must be finite and > 0"),
    (["--nproc", "-2", "--plan", "auto"], "--nproc -2"),
    (["--nproc", "0"], "--nproc 0"),
    (["--global-batch", "0"], "--global-batch"),
    (["--nproc", "2", "--plan", "auto", "--virtual-stages", "2"], "drop --virtual-stages"),
    # the planner's --gpus is this run's --nproc
    (["--nproc", "2", "--plan", "auto", "--tp", "3"],
     "--tp 3 does not divide --nproc 2: choose --tp from"),
    (["--nproc", "2", "--plan", "auto", "--dp", "2", "--global-batch", "3"],
     "add ranks (--nproc), or shrink --global-batch/--seq-len"),
    (["--nproc", "2", "--eval-every", "5", "--eval-batches", "0"],
     "--eval-every 5 with --eval-batches 0: validation is off; raise --eval-batches"),
    (["--eval-every", "-1"], "--eval-every -1: use 0 (the end only) or a step count"),
    (["--nproc", "2", "--steps", "10", "--warmup-steps", "1000"],
     "--warmup-steps 1000: the warm-up must end before the learning-rate schedule's last step "
     "(--steps 10); lower --warmup-steps below 10, or raise --steps"),
    (["--nproc", "2", "--save-on-signal", "SIGTERM,INT"],
     "--save-on-signal SIGTERM,INT: 'INT' is not one of SIGTERM, SIGUSR1, SIGUSR2; name them"),
    # a flag given that the run would not use: refused, not trained without
    (["--sequence-parallel"], "--sequence-parallel shards activations inside a TP group: raise "
                              "--tp, or drop it (this run would not use it)"),
    (["--nproc", "2", "--vocab-parallel", "on"], "--vocab-parallel on splits the vocabulary"),
    (["--nproc", "2", "--schedule", "zb-h1"], "--schedule zb-h1 orders a pipeline's"),
    (["--nproc", "2", "--pp", "2", "--virtual-stages", "3"],
     "--virtual-stages 3 is read by --schedule interleaved-1f1b at --pp > 1 only"),
    (["--override-optim"], "--override-optim applies to a --resume only"),
    (["--nproc", "2", "--batch-split", "2"], "--batch-split 2 splits micro-batches to overlap "
     "TP's all-reduces: raise --tp, or drop it (this run would not use it)"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--batch-split", "2"],
     "--batch-split 2 splits micro-batches to overlap TP's all-reduces, which "
     "--sequence-parallel replaces with reduce-scatters: drop one of them"),
    (["--nproc", "2", "--overlap", "chunked"], "--overlap chunked sets how TP's row-parallel "
     "GEMMs overlap their all-reduce: raise --tp, or drop it (this run would not use it)"),
    (["--overlap", "none"], "--overlap none sets how TP's row-parallel GEMMs"),
    (["--nproc", "2", "--data-dtype", "uint32"], "--data-dtype uint32 reads .bin token files, "
     "and the default corpus is text (read as bytes): pass a .bin --data, or drop it (this "
     "run would not use it)"),
    (["--nproc", "2", "--override-data"], "--override-data applies to a --resume only"),
])
def test_bad_input(capsys, argv, words):
    assert words in _err(capsys, argv)


def test_a_rank_of_the_launcher_runs_the_config_it_is_given(monkeypatch, tmp_path):
    """The launcher passes its checked config to its ranks: with --plan auto, a --schedule
    given with it stays when the plan has no pipeline, and the ranks refused it (the flag
    check is the launcher's, on the command the user wrote)."""
    from distllm.train.launch import USAGE_ERRORS_ENV

    argv = ["train", "--model", "tiny", "--schedule", "zb-h1", "--steps", "1", "--global-batch",
            "2", "--seq-len", "16", "--eval-batches", "0", "--no-save", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # the user's command: refused
    monkeypatch.setenv(USAGE_ERRORS_ENV, str(tmp_path))
    assert main(argv) == 0 and not list(tmp_path.glob("rank*.txt"))


def test_empty_data(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in _err(capsys, ["--data", str(tmp_path / "empty.txt")])
    (tmp_path / "folder").mkdir()
    assert "no text files" in _err(capsys, ["--data", str(tmp_path / "folder")])


def test_nproc_limit_is_cores_times_four(capsys):
    assert f"1..{_cores() * 4}" in _err(capsys, ["--nproc", str(_cores() * 4 + 1)])


def test_nproc_on_a_gpu_machine_is_at_most_one_rank_per_gpu(capsys, monkeypatch):
    """Each rank trains on a GPU of its own: more ranks than GPUs are refused in one line
    (before, they failed in NCCL, two ranks on one GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "this machine shows 1 GPUs, one per rank; choose 1..1 ranks" in _err(
        capsys, ["--nproc", "2"])


def test_resume_refuses_another_model(capsys, corpus, tmp_path):
    out = tmp_path / "run"
    run_distributed(train_many, 1, [dict(steps=1, n_layers=2, save_final=True, out=str(out))],
                    corpus, str(tmp_path), timeout=300)
    line = _err(capsys, ["--resume", "--out", str(out), "--data", corpus, "--seq-len", "32"])
    assert "different model" in line and "n_layers: checkpoint 2 vs run 4" in line
    assert line.endswith("): pass --n-layers 2, or another --out"), line
    line = _err(capsys, ["--resume", "--out", str(out), "--model", "gpt2-small"])
    assert line.endswith("): pass the checkpoint's --model (and --n-layers), or another --out")
    assert "no complete checkpoint" in _err(capsys, ["--resume", "--out", str(tmp_path / "x")])
    # a folder holding a run that saved no checkpoint: no advice that leads back here
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text('{"step": 1}\n')
    line = _err(capsys, ["--resume", "--out", str(tmp_path / "m")])
    assert line.endswith("only a previous run's metrics.jsonl: pass another --out"), line


def test_out_must_be_a_folder_it_can_create(capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    line = _err(capsys, ["--nproc", "2", "--out", str(tmp_path / "afile")])
    assert f"--out {tmp_path / 'afile'}: it is a file" in line
    line = _err(capsys, ["--out", str(tmp_path / "afile" / "sub")])
    assert f"--out {tmp_path / 'afile' / 'sub'}: cannot create the folder" in line


# --- under --nproc: what a rank finds, a failed rank, a signal ----------------------------

TINY = ["--model", "tiny", "--steps", "1", "--eval-batches", "0", "--seq-len", "32",
        "--no-progress", "--timeout", "60"]


def _one_line(capfd, argv: list[str]) -> str:
    """The one stderr line of ``distllm train argv`` (exit code 2); the ranks are processes
    writing to this one's stderr, hence ``capfd``."""
    from distllm.train.launch import USAGE_ERRORS_ENV

    before = signal.getsignal(signal.SIGTERM)
    rc = main(["train", *argv])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("distllm train: error: "), err
    # the launcher leaves this process as it found it
    assert signal.getsignal(signal.SIGTERM) == before
    assert USAGE_ERRORS_ENV not in os.environ
    return err[0]


def test_bad_input_a_rank_finds_is_one_line(capfd, tmp_path):
    """The data too short for one global batch is found by the ranks (which load it)."""
    (tmp_path / "small.txt").write_text("x" * 600)  # 300 training tokens: 9 windows of 33
    line = _one_line(capfd, ["--nproc", "2", *TINY, "--global-batch", "16", "--data",
                             str(tmp_path / "small.txt"), "--out", str(tmp_path / "run")])
    assert "fewer than one global batch of 16: lower --global-batch" in line


def test_token_ids_past_the_vocabulary_are_one_line(capfd, tmp_path):
    """Ids 0..20000 fed to the 256-id tiny model: the largest of the training part (the last
    4096 are held out) is named, once, by every rank before a step."""
    import numpy as np

    np.arange(20_001).astype(np.uint16).tofile(tmp_path / "gpt2.bin")
    line = _one_line(capfd, ["--nproc", "2", *TINY, "--global-batch", "4", "--data",
                             str(tmp_path / "gpt2.bin"), "--out", str(tmp_path / "run")])
    assert "token id 15904 is beyond the vocabulary of --model tiny (256 ids)" in line, line


def test_ids_beyond_the_vocabulary_past_the_scan_are_one_line(capfd, tmp_path):
    """Ids beyond the vocabulary after the first 1M (which are checked before a step) are
    found by the loader; every DP rank checks the whole global batch, so all refuse it at
    the same step and the launcher prints the one message."""
    import numpy as np

    from distllm.train.data import SCAN_IDS

    ids = (np.arange(SCAN_IDS + 200_000) % 256).astype(np.uint16)
    ids[SCAN_IDS:] = 300
    ids.tofile(tmp_path / "train.bin")
    (np.arange(5_000) % 256).astype(np.uint16).tofile(tmp_path / "val.bin")
    rc = main(["train", "--nproc", "2", *TINY, "--steps", "1000", "--global-batch", "8",
               "--data", str(tmp_path), "--out", str(tmp_path / "run")])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2, err
    # the banner (the run started), then the one error
    assert len(err) == 2 and err[0].startswith("distllm train: tiny"), err
    assert err[1] == ("distllm train: error: the data holds token ids beyond the model's "
                      "vocabulary of 256 ids: choose a --model whose vocabulary covers the "
                      "data's tokenizer (gpt2-* for GPT-2's), or check --data-dtype"), err


def test_uint32_ids_read_as_uint16_are_refused(capsys, tmp_path):
    import numpy as np

    (np.arange(20_000) % 256).astype(np.uint32).tofile(tmp_path / "ids.bin")
    line = _err(capsys, ["--data", str(tmp_path / "ids.bin"), "--steps", "1", "--out",
                         str(tmp_path / "run")])
    assert "every other uint16 id is 0, as in a file of uint32 ids" in line, line
    assert "pass --data-dtype uint32" in line, line


def test_a_folder_of_token_files_trains(tmp_path):
    import numpy as np

    (np.arange(20_000) % 256).astype(np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(5_000) % 256).astype(np.uint16).tofile(tmp_path / "val.bin")
    assert main(["train", "--nproc", "2", *TINY, "--global-batch", "4", "--data", str(tmp_path),
                 "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_init_from_trains_saying_so_once(capfd, tmp_path):
    """Under --nproc every rank reads the model; transformers' log and progress bars stay
    quiet, the banner names the folder."""
    from tests.train.test_hf import _save_tiny_hf

    _save_tiny_hf(tmp_path / "hf")
    capfd.readouterr()
    assert main(["train", "--nproc", "2", "--tp", "2", *TINY, "--global-batch", "4",
                 "--init-from", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f", weights from {tmp_path / 'hf'}"), err
    # pretrained weights: every position trained (`distllm sample` may use them all)
    assert checkpoint.meta_of(checkpoint.latest(tmp_path / "run"))["trained_positions"] == 128


def test_init_from_refuses_another_shape_or_no_model(capsys, tmp_path):
    from tests.train.test_hf import _save_tiny_hf

    _save_tiny_hf(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar of the save
    line = _err(capsys, ["--nproc", "2", "--model", "gpt2-small", "--init-from",
                         str(tmp_path / "hf")])
    assert line.endswith(f"--init-from {tmp_path / 'hf'}: its model has vocab_size=256 (--model "
                         "gpt2-small: 50257), n_layers=4 (--model gpt2-small: 12), hidden_size=128 "
                         "(--model gpt2-small: 768), n_heads=4 (--model gpt2-small: 12), "
                         "ffn_hidden_size=512 (--model gpt2-small: 3072), max_seq_len=128 "
                         "(--model gpt2-small: 1024): pass --model tiny"), line
    # the preset fits; --n-layers does not
    for n_layers in ("2", "6"):
        line = _err(capsys, ["--model", "tiny", "--n-layers", n_layers, "--init-from",
                             str(tmp_path / "hf")])
        assert line.endswith(f"its model has n_layers=4 (--n-layers: {n_layers}): drop "
                             f"--n-layers"), line
    import shutil

    shutil.copytree(tmp_path / "hf", tmp_path / "hf3")
    conf = json.loads((tmp_path / "hf3" / "config.json").read_text())
    (tmp_path / "hf3" / "config.json").write_text(json.dumps({**conf, "n_layer": 3}))
    line = _err(capsys, ["--model", "tiny", "--n-layers", "2", "--init-from",
                         str(tmp_path / "hf3")])
    assert line.endswith("its model has n_layers=3 (--n-layers: 2): pass --n-layers 3"), line
    line = _err(capsys, ["--model", "tiny", "--init-from", str(tmp_path / "hf3")])
    assert line.endswith("its model has n_layers=3 (--model tiny: 4): pass --model tiny "
                         "--n-layers 3"), line
    line = _err(capsys, ["--init-from", str(tmp_path / "nothing")])
    assert line.endswith(f"--init-from {tmp_path / 'nothing'}: it is not a folder; pass a folder "
                         "written by a Hugging Face model's save_pretrained"), line
    line = _err(capsys, ["--init-from", str(tmp_path)])
    assert f"--init-from {tmp_path}: it holds no config.json" in line, line


def test_a_fresh_run_refuses_old_checkpoints_and_resume_checks_the_batch(capfd, tmp_path):
    out = str(tmp_path / "run")
    assert main(["train", "--nproc", "2", *TINY, "--global-batch", "4", "--out", out]) == 0
    capfd.readouterr()
    line = _one_line(capfd, ["--nproc", "2", *TINY, "--global-batch", "4", "--out", out])
    assert (f"--out {out} holds a previous run's checkpoints (step 1): pass --resume to "
            "continue it, or another --out") in line
    line = _one_line(capfd, ["--nproc", "2", *TINY, "--steps", "2", "--global-batch", "8",
                             "--out", out, "--resume"])  # found after the ranks load it
    assert "global_batch=4, this run 8: resume with --global-batch 4" in line
    assert "damaged" not in line, line  # bad input, not a damaged checkpoint


def test_a_second_run_into_the_out_of_a_running_one_is_refused(capsys, tmp_path):
    """Two runs into one --out at once each passed the check of --out (neither had saved),
    then replaced each other's checkpoints and metrics: the run's rank 0 (or --nproc's
    launcher, for its ranks) holds --out's lock while it runs, and a second run is refused."""
    from distllm.train.resume import out_lock

    out = str(tmp_path / "run")
    with out_lock(out):  # a run in progress
        line = _err(capsys, ["--nproc", "2", *TINY, "--out", out])  # the launcher
        assert line.endswith(f"--out {out} is in use by another run (pid {os.getpid()} on "
                             f"{os.uname().nodename}): wait for it to end, or pass another "
                             f"--out"), line
        line = _err(capsys, [*TINY, "--out", out])  # one process: train()'s rank 0
        assert f"--out {out} is in use by another run" in line, line
        with out_lock(out, rank=1):  # (only rank 0 locks)
            pass
    assert not (Path(out) / "metrics.jsonl").exists()
    assert main(["train", *TINY, "--out", out]) == 0  # it ended: a run goes ahead


@pytest.mark.parametrize("name, kind", [("checkpoints", "a file"),
                                        ("metrics.jsonl", "a folder")])
def test_an_out_holding_what_the_run_writes_as_another_kind_is_refused(capsys, tmp_path,
                                                                      name, kind):
    """A file named checkpoints trained every step, then failed at the save telling the
    user to free space; a folder named metrics.jsonl, a rank's traceback."""
    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if kind == "a folder" else (out / name).write_text("")
    line = _err(capsys, ["--nproc", "2", *TINY, "--out", str(out)])
    assert line.endswith(f"--out {out} holds {name} as {kind}, which the run writes as "
                         f"{'a folder' if kind == 'a file' else 'a file'}: remove it, or pass "
                         f"another --out"), line


def test_a_stray_world_size_without_rank_is_one_process(tmp_path, monkeypatch):
    """WORLD_SIZE set, RANK not (left over in a shell): the process group is one process
    (torch reads the environment only with both), and the layout was planned for
    WORLD_SIZE ranks: "Rank 1 is out of range", naming no flag."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", *TINY, "--out", str(tmp_path / "run")]) == 0


def test_a_failed_rank_is_named_once(capsys, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from distllm.train.launch import report_failure

    none = str(tmp_path / "no-error-file")
    crashed = ChildFailedError("distllm", {1: ProcessFailure(1, 10, 1, none)})
    killed = ChildFailedError("distllm", {0: ProcessFailure(0, 11, -9, none)})
    assert report_failure(crashed, tmp_path, 2) == 1
    assert report_failure(killed, tmp_path, 2) == 1
    assert capsys.readouterr().err.splitlines() == [
        "distllm train: error: rank 1 failed (exit code 1); its traceback is above",
        "distllm train: error: rank 0 was killed by SIGKILL"]
    # a rank that timed out in a collective: one line naming it and the silent ranks, unless
    # another rank failed on its own (that one is the cause)
    (tmp_path / "timeout-rank0.txt").write_text("waited longer than --timeout 5 s for a "
                                                "collective (Timed out waiting 5000ms)")
    assert report_failure(killed, tmp_path, 2) == 1
    assert report_failure(crashed, tmp_path, 2) == 1
    assert capsys.readouterr().err.splitlines() == [
        "distllm train: error: rank 0 waited longer than --timeout 5 s for a collective (Timed "
        "out waiting 5000ms); ranks [1] did not answer (stalled, or died)",
        "distllm train: error: rank 1 failed (exit code 1); its traceback is above"]
    (tmp_path / "timeout-rank0.txt").unlink()
    # a rank that lost its peer (that peer died): the peer is named, though the rank that
    # lost it exited first; a lost peer alone is one line naming the rank that saw it
    (tmp_path / "lost-rank0.txt").write_text("Connection reset by peer")
    both = ChildFailedError("distllm", {0: ProcessFailure(0, 10, 1, none),
                                        1: ProcessFailure(1, 11, -9, none)})
    both.failures[0].timestamp, both.failures[1].timestamp = 1, 2
    assert report_failure(both, tmp_path, 2) == 1
    lone = ChildFailedError("distllm", {0: ProcessFailure(0, 10, 1, none)})
    assert report_failure(lone, tmp_path, 2) == 1
    assert capsys.readouterr().err.splitlines() == [
        "distllm train: error: rank 1 was killed by SIGKILL",
        "distllm train: error: rank 0 lost its connection to another rank (Connection reset by "
        "peer): a rank died, or the network between them failed"]
    (tmp_path / "lost-rank0.txt").unlink()
    for rank, msg in ((2, "b"), (0, "a"), (1, "a")):
        (tmp_path / f"rank{rank}.txt").write_text(msg)
    assert report_failure(crashed, tmp_path, 2) == 2
    assert capsys.readouterr().err.splitlines() == ["distllm train: error: a",
                                                    "distllm train: error: b"]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig,save_on", [(signal.SIGTERM, None), (signal.SIGUSR1, None),
                                         (signal.SIGINT, None), (signal.SIGTERM, "none"),
                                         (signal.SIGUSR1, "none")],
                         ids=["SIGTERM", "SIGUSR1", "SIGINT", "SIGTERM-not-saving",
                              "SIGUSR1-not-saving"])
def test_a_signal_stops_the_ranks(tmp_path, sig, save_on):
    """The ranks run in sessions of their own: the launcher passes a signal on to them, and
    the job ends with one line (no rank's traceback for Ctrl-C). A signal of
    ``--save-on-signal`` (SIGTERM, SIGUSR1 by default) stops them after a step with a
    checkpoint at the last step ``metrics.jsonl`` has; Ctrl-C stops them at once."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    ranks: list[int] = []
    extra = [] if save_on is None else ["--save-on-signal", save_on]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distllm", "train", "--nproc", "2",
                                 *TINY, "--steps", "100000", "--global-batch", "4", "--out",
                                 str(out), *extra], stderr=err, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.time() < deadline, "no step was done"
            time.sleep(0.05)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.time() + 10
        while any(map(_alive, ranks)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "a rank outlived the launcher"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    err = log.read_text()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.splitlines()[-1] == f"distllm train: stopped by {sig.name}", err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    saved = sorted(p.name for p in (out / "checkpoints").glob("*"))
    if sig == signal.SIGINT or save_on == "none":  # (SIGUSR1 too ends the ranks, passed on)
        assert saved == [], saved
        return
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert saved == [f"step_{last:08d}"], (saved, last)
    assert (f"stopped by {sig.name} after step {last} of 100000 (--save-on-signal): checkpoint "
            f"saved in {out}; continue with --resume") in err.splitlines(), err[-2000:]


_HELD_KEEP_ALIVE = """
import os, pathlib, signal, sys, threading, time
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from distllm.train.launch import launch

out, held = pathlib.Path(sys.argv[1]), threading.Event()
keep_alive = DynamicRendezvousHandler._keep_alive

def held_keep_alive(self):  # holds the handler, as a slow store round trip would
    keep_alive(self)
    held.set()
    self._keep_alive_timer._ctx.stop_event.wait(10)

DynamicRendezvousHandler._keep_alive = held_keep_alive

def interrupt():
    held.wait()
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
code = launch(2, sys.argv[2:], 60)
for t in threading.enumerate():  # (what a thread prints as it ends belongs to the run)
    if t is not threading.current_thread() and not t.name.startswith("Thread-"):
        t.join(15)
sys.exit(code)
"""


def test_a_signal_while_the_rendezvous_keep_alive_runs_ends_with_one_line(tmp_path):
    """The rendezvous keep-alive thread, mid heartbeat (holding the handler) when Ctrl-C stops
    the launcher: the launcher shuts the rendezvous down, and its last line stays its own.
    Before, the handler was dropped while that thread held it, the timer's finalizer ran in
    the thread and printed "RuntimeError: cannot join current thread" after it."""
    script, out = tmp_path / "held.py", tmp_path / "run"
    script.write_text(_HELD_KEEP_ALIVE)
    proc = subprocess.run([sys.executable, str(script), str(out), *TINY, "--steps", "100000",
                           "--global-batch", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == "distllm train: stopped by SIGINT", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_ranks_end_with_a_launcher_killed_by_sigkill(tmp_path):
    """SIGKILL cannot be passed on: the ranks of a launcher killed so (kill -9, the OOM
    killer) trained on to the end and kept writing checkpoints into --out. They get SIGTERM
    when it dies and stop after a step, saving a checkpoint there (--save-on-signal). (The
    launcher killed so leaves its temporary folder: in ``tmp_path``, not the system's.)"""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distllm", "train", "--nproc", "2",
                                 *TINY, "--steps", "100000", "--global-batch", "4", "--out",
                                 str(out)], stderr=err, start_new_session=True,
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    ranks: list[int] = []
    try:
        _until_a_step(proc, out, log)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.time() + 60
        while any(map(_alive, ranks)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "a rank outlived its launcher killed by SIGKILL"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert sorted(p.name for p in (out / "checkpoints").glob("*")) == [f"step_{last:08d}"]


def test_ctrl_c_again_kills_the_ranks_the_launcher_waits_for(tmp_path):
    """Ctrl-C while a rank is stalled: the launcher passes it on and waits up to --timeout
    for the ranks; Ctrl-C again ends that wait, and the launcher ended with its ranks still
    running (the stalled one until its collective timed out, or for good). Now it kills them
    at once, and says so."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distllm", "train", "--nproc", "2",
                                 *TINY, "--steps", "100000", "--global-batch", "4", "--out",
                                 str(out), "--timeout", "120"],
                                stderr=err, start_new_session=True)
    ranks: list[int] = []
    try:
        _until_a_step(proc, out, log)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(max(ranks), signal.SIGSTOP)  # a rank stalled: the other waits on it
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # waiting for the ranks (up to --timeout)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        assert not any(map(_alive, ranks)), "the launcher ended before its ranks"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    lines = log.read_text().splitlines()
    assert proc.returncode == 128 + signal.SIGINT, lines[-20:]
    assert lines[-1] == ("distllm train: stopped by SIGINT; the ranks still running were "
                         "killed"), lines[-20:]


def _until_a_step(proc, out: Path, log: Path) -> None:
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.time() < deadline, "no step was done"
        time.sleep(0.05)


@pytest.mark.parametrize("nproc", [None, 2], ids=["one-process", "ranks-of-nproc"])
def test_a_run_stopped_by_a_signal_exits_as_stopped(tmp_path, nproc):
    """SIGUSR1 to the training processes alone (not to a launcher): they save and exit with
    128 + the signal, not 0 (a scheduler or a script must not take the run for finished);
    under --nproc the launcher says so in one line."""
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    launch = [] if nproc is None else ["--nproc", str(nproc)]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "distllm", "train", *launch, *TINY,
                                 "--steps", "100000", "--global-batch", "4", "--out", str(out)],
                                stderr=err, start_new_session=True)
    ranks: list[int] = []
    try:
        _until_a_step(proc, out, log)
        ranks = [proc.pid] if nproc is None else _children(proc.pid)
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        proc.wait(timeout=60)
    finally:
        for pid in {proc.pid, *ranks}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    err = log.read_text()
    assert proc.returncode == 128 + signal.SIGUSR1, err[-2000:]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert sorted(p.name for p in (out / "checkpoints").glob("*")) == [f"step_{last:08d}"]
    lines = err.splitlines()
    assert (f"stopped by SIGUSR1 after step {last} of 100000 (--save-on-signal): checkpoint "
            f"saved in {out}; continue with --resume") in lines, err[-2000:]
    if nproc is not None:
        assert lines[-1] == "distllm train: stopped by SIGUSR1", err[-2000:]
    assert "Traceback" not in err, err[-2000:]


# --- flags generated from the config dataclasses --------------------------------------

# every flag of the hand-written parser this one replaced, with its default
OLD_FLAGS = {
    "--nproc": None, "--tp": 1, "--pp": 1, "--dp": -1, "--zero": 0, "--schedule": "1f1b",
    "--micro-batches": 0, "--virtual-stages": 2, "--sequence-parallel": False,
    "--overlap": "auto", "--plan": "none", "--bucket-cap-mb": 25.0, "--timeout": 300.0,
    "--model": "tiny", "--global-batch": 32, "--seq-len": 0, "--steps": 300, "--seed": 1234,
    "--dtype": "float32", "--activation-checkpointing": "none", "--data": None,
    "--out": "runs/train", "--resume": False, "--n-layers": 0, "--stop-after": 0,
    "--save-every": 0, "--no-save": True, "--eval-batches": 8, "--no-progress": True,
    "--deterministic": False, "--lr": 3e-3, "--min-lr-ratio": 0.1, "--warmup-steps": -1,
    "--weight-decay": 0.1, "--grad-clip": 1.0,
}


def _parser():
    import argparse

    from distllm.train.cli import add_arguments

    p = argparse.ArgumentParser(prog="distllm train")
    add_arguments(p)
    return p


def test_every_old_flag_keeps_its_name_and_default():
    p = _parser()
    actions = {s: a for a in p._actions for s in a.option_strings}
    assert set(OLD_FLAGS) <= set(actions), set(OLD_FLAGS) - set(actions)
    from distllm.train.cli import UNSET, flags

    real = {f.flag: f.default for f in flags()}
    for flag, default in OLD_FLAGS.items():
        if actions[flag].dest in UNSET:  # parsed as None (not given); the config's default
            assert actions[flag].default is None and real[flag] == default, flag
        else:
            assert actions[flag].default == default, (flag, actions[flag].default, default)


def test_no_flags_give_the_default_config():
    from distllm.train.cli import config_from_args
    from distllm.train.config import TrainConfig

    assert config_from_args(_parser().parse_args([])) == TrainConfig()


def test_each_flag_sets_its_field():
    from distllm.train.cli import config_from_args
    from distllm.train.config import OptimConfig, ParallelConfig, TrainConfig

    argv = ("--tp 2 --pp 2 --dp 3 --zero 2 --schedule interleaved-1f1b --micro-batches 4 "
            "--virtual-stages 3 --sequence-parallel --overlap chunked --bucket-cap-mb 4.5 "
            "--timeout 60 --model gpt2-small --global-batch 24 --seq-len 64 --steps 9 "
            "--seed 5 --dtype bfloat16 --activation-checkpointing selective --data d.txt "
            "--out o --resume --n-layers 3 --stop-after 4 --save-every 2 --no-save "
            "--eval-batches 0 --no-progress --deterministic --lr 0.01 --min-lr-ratio 0.2 "
            "--warmup-steps 3 --weight-decay 0.05 --beta1 0.8 --beta2 0.9 --eps 1e-6 "
            "--grad-clip 0.5").split()
    want = TrainConfig(
        model="gpt2-small", global_batch=24, seq_len=64, steps=9, seed=5, dtype="bfloat16",
        activation_checkpointing="selective", data="d.txt", out="o", resume=True, n_layers=3,
        stop_after=4, save_every=2, save_final=False, eval_batches=0, progress=False,
        deterministic=True,
        parallel=ParallelConfig(tp=2, pp=2, dp=3, zero=2, schedule="interleaved-1f1b",
                                micro_batches=4, virtual_stages=3, sequence_parallel=True,
                                overlap="chunked", bucket_cap_mb=4.5, timeout_s=60.0),
        optim=OptimConfig(lr=0.01, min_lr_ratio=0.2, warmup_steps=3, weight_decay=0.05,
                          beta1=0.8, beta2=0.9, eps=1e-6, grad_clip=0.5))
    assert config_from_args(_parser().parse_args(argv)) == want


@pytest.mark.parametrize("kw", [
    {},
    dict(steps=3, out="/tmp/x", save_final=False, progress=False, data="c.txt"),
    dict(activation_checkpointing="full", dtype="float64", resume=True),
    dict(out="-run", data="--data.txt"),  # values that look like flags stay values
])
def test_config_to_argv_round_trips(kw):
    from distllm.train.cli import config_from_args, config_to_argv
    from distllm.train.config import OptimConfig, ParallelConfig, TrainConfig

    for par in (ParallelConfig(), ParallelConfig(tp=2, pp=2, schedule="gpipe", timeout_s=7.0,
                                                 sequence_parallel=True)):
        cfg = TrainConfig(parallel=par, optim=OptimConfig(lr=1e-4, beta2=0.99), **kw)
        assert config_from_args(_parser().parse_args(config_to_argv(cfg))) == cfg


def test_help_comes_from_the_field_docstrings(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("Collective timeout in seconds: a dead rank ends the job after at most this "
                  "long. (default: 300.0)",
                  "-1 uses 5% of the schedule's steps (at least 1)",  # a literal % survives
                  "--schedule {gpipe,1f1b,interleaved-1f1b,zb-h1}",
                  # a group's description whole, not its docstring's first line
                  "optimizer: AdamW with linear warm-up then a decay (cosine by default), and",
                  "norm gradient clipping. --lr",
                  "--no-save Save a checkpoint after the last step. On by default: this flag "
                  "turns it off.",
                  "--timeout TIMEOUT Collective timeout",
                  "Stop this run after this many steps in total (0: run to steps), saving",
                  "--nproc NPROC start torchrun",
                  # what the engine's decay groups leave out (engine._decay_groups)
                  "not on biases, norms or the position embedding wpe"):
        assert words in out, words


def test_flags_of_a_config_class():
    import dataclasses

    from distllm.train.cli import field_docs, flags

    @dataclasses.dataclass
    class Cfg:
        a: int = 1
        """The a."""
        b: str = dataclasses.field(default="x", metadata={"choices": ("x",)})
        """The
        b, 5%."""
        on: bool = True
        """Turned on."""

    assert field_docs(Cfg) == {"a": "The a.", "b": "The b, 5%.", "on": "Turned on."}
    a, b, on = flags((("x", Cfg, None),))
    assert (a.flag, a.default, a.kwargs["type"]) == ("--a", 1, int)
    assert (b.flag, b.kwargs["choices"], b.kwargs["help"]) == (
        "--b", ("x",), "The b, 5%%. (default: %(default)s)")
    assert (on.flag, on.kwargs["action"], on.kwargs["help"]) == (
        "--no-on", "store_false", "Turned on. On by default: this flag turns it off.")

    @dataclasses.dataclass
    class Undocumented:
        a: int = 1
        """The a."""
        c: float = 0.0

    with pytest.raises(TypeError, match="Undocumented.c has no docstring: write one under it"):
        flags((("x", Undocumented, None),))



def test_plan_auto_pins_the_layout_flags_given_with_it():
    """``--plan auto --tp 2 --zero 0`` plans with tp=2 and ZeRO-0 pinned, as ``distllm plan``
    does (the planner alone picks another layout for the tiny model on 2 ranks)."""
    from distllm.train.cli import apply_plan, config_from_args, given_layout

    args = _parser().parse_args(["--plan", "auto", "--tp", "2", "--zero", "0"])
    assert given_layout(args) == {"tp": 2, "zero": 0}
    cfg, _ = apply_plan(config_from_args(args), 2, given_layout(args))
    assert (cfg.parallel.tp, cfg.parallel.zero) == (2, 0)
    free, _ = apply_plan(config_from_args(_parser().parse_args(["--plan", "auto"])), 2)
    assert (free.parallel.tp, free.parallel.zero) != (2, 0)
    assert free.parallel.tp == 1  # (so the pin below is what makes it tp 2)
    # a pinned --sequence-parallel is a requirement: never a tp-1 layout without it
    args = _parser().parse_args(["--plan", "auto", "--sequence-parallel"])
    sp, _ = apply_plan(config_from_args(args), 2, given_layout(args))
    assert (sp.parallel.tp, sp.parallel.sequence_parallel) == (2, True)
    args = _parser().parse_args(["--plan", "auto", "--sequence-parallel", "--tp", "1"])
    with pytest.raises(ValueError) as e:
        apply_plan(config_from_args(args), 2, given_layout(args))
    assert str(e.value).startswith("--sequence-parallel shards activations inside a TP group, "
                                   "and --tp 1 leaves tp=1: raise --tp, or drop "
                                   "--sequence-parallel"), str(e.value)


def test_auto_resume_takes_the_resume_only_flags(tmp_path):
    """--override-* with --auto-resume: a first attempt starts fresh, its restarts resume;
    not refused as on a fresh run (whose message named --resume, refused with it)."""
    from distllm.cli import UsageError
    from distllm.train.cli import check_unused, config_from_args
    from distllm.train.resume import resolve_auto_resume

    for extra, refused in ((["--auto-resume"], False), ([], True)):
        args = _parser().parse_args(["--out", str(tmp_path / "r"), "--override-data", *extra])
        cfg = resolve_auto_resume(config_from_args(args))
        assert not cfg.resume
        if refused:
            with pytest.raises(UsageError, match="--override-data applies to a --resume only"):
                check_unused(args, cfg)
        else:
            check_unused(args, cfg)


@pytest.mark.parametrize("argv, refused", [
    (["--schedule", "1f1b"], False),  # the default: a sweep may write every flag
    (["--virtual-stages", "2", "--pp", "1"], False),
    (["--schedule", "gpipe"], True),
    (["--virtual-stages", "4"], True),
    (["--vocab-parallel", "on"], True),
    (["--vocab-parallel", "off"], False),
    # under --plan auto, a flag of a dimension the planned layout lacks (here tp 1, as the
    # planner may pick) is refused, not dropped: pin --tp to keep it; --schedule is the
    # planner's to choose
    (["--plan", "auto", "--vocab-parallel", "on"], True),
    (["--plan", "auto", "--schedule", "gpipe"], False),
    (["--plan", "auto", "--override-data"], True),
    (["--batch-split", "0", "--overlap", "auto", "--data-dtype", "uint16"], False),
    (["--tp", "2", "--batch-split", "2", "--overlap", "chunked"], False),
    (["--tp", "2", "--sequence-parallel", "--batch-split", "1"], True),
    (["--batch-split", "1"], True),
    (["--plan", "auto", "--batch-split", "2", "--overlap", "none"], True),
    (["--plan", "auto", "--data-dtype", "uint32"], True),
])
def test_a_flag_at_its_default_is_not_refused(argv, refused):
    from distllm.cli import UsageError
    from distllm.train.cli import check_unused, config_from_args

    args = _parser().parse_args(argv)
    cfg = config_from_args(args)  # (tp 1, pp 1: as --plan auto could pick)
    if refused:
        with pytest.raises(UsageError, match="this run would not use it"):
            check_unused(args, cfg)
    else:
        check_unused(args, cfg)


def test_a_token_dtype_for_text_data_is_refused(capsys, tmp_path):
    """--data-dtype reads .bin token files: with a text file it was dropped silently."""
    text = tmp_path / "notes.txt"
    text.write_text("some text\n" * 100)
    assert _err(capsys, ["--nproc", "2", "--data", str(text), "--data-dtype", "uint32"]).endswith(
        f"--data-dtype uint32 reads .bin token files, and --data {text} is text (read as "
        f"bytes): pass a .bin --data, or drop it (this run would not use it)")
    # a .bin file the flag reads: not refused (the run is refused later, its world checked)
    ids = tmp_path / "ids.bin"
    ids.write_bytes(bytes(64))
    assert "--data-dtype" not in _err(capsys, ["--nproc", "2", "--data", str(ids),
                                               "--data-dtype", "uint32", "--tp", "3"])


def _checkpoint_at(out: Path, step: int) -> None:
    import json

    from distllm.models.config import GPTConfig
    from distllm.train import checkpoint

    d = out / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({
        "format": checkpoint.FORMAT, "step": step,
        "model": checkpoint._model_key(GPTConfig.preset("tiny")), "model_name": "tiny"}))


def test_resume_past_the_steps_or_the_stop_is_refused(capsys, tmp_path):
    """A resumed run with nothing to train says so (it printed "resumed from step 6" and a
    validation loss "after 4 steps", or "stopped after step 30" having run nothing)."""
    out = tmp_path / "run"
    _checkpoint_at(out, 6)
    base = ["--model", "tiny", "--out", str(out), "--resume"]
    assert ("checkpoint in --out " + str(out) + " is at step 6, where --steps 4 ends: raise "
            "--steps") in _err(capsys, [*base, "--steps", "4"])
    assert "--steps 6 ends" in _err(capsys, [*base, "--steps", "6"])
    assert ("--stop-after 5: the run resumes after step 6; raise --stop-after"
            in _err(capsys, [*base, "--steps", "9", "--stop-after", "5"]))


def test_resume_refuses_a_seed_other_than_its_checkpoints(capsys, tmp_path):
    """A resume keeps its checkpoint's data order (the loader takes the checkpoint's seed):
    another --seed with --resume was dropped without a word. The checkpoint's own seed, or
    none given (the default), goes on to the resume's other checks."""
    out = tmp_path / "run"
    _checkpoint_at(out, 6)
    meta = out / "checkpoints" / "step_00000006" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "data": {
        "epoch": 0, "index": 12, "seed": 5, "global_batch": 2, "seq_len": 32}}))
    base = ["--model", "tiny", "--out", str(out), "--resume", "--steps", "4"]
    for seed in ("9", "1234"):  # (1234: the default, given)
        assert _err(capsys, [*base, "--seed", seed]).endswith(
            f"--seed {seed}: a --resume keeps the data order of its checkpoint in --out {out}, "
            f"shuffled with --seed 5: pass --seed 5, or drop it (this run would not use it)")
    for seed in (["--seed", "5"], []):
        assert "is at step 6, where --steps 4 ends: raise --steps" in _err(capsys,
                                                                          [*base, *seed])


def test_a_fresh_run_refuses_an_earlier_runs_metrics(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert f"--out {out} holds a previous run's metrics.jsonl" in _err(
        capsys, ["--model", "tiny", "--out", str(out)])


def test_a_damaged_checkpoint_is_one_line_naming_the_previous_one(capfd, tmp_path):
    """A checkpoint whose files cannot be read: one line on every path (DCP's shards, read
    collectively; one rank's random state, which the other ranks learn of; meta.json), exit
    code 2, naming the complete checkpoint before it."""
    import shutil

    out = tmp_path / "run"
    common = ["--nproc", "2", "--dp", "2", *TINY, "--global-batch", "4", "--out", str(out)]
    assert main(["train", *common, "--steps", "6", "--save-every", "2",
                 "--stop-after", "4"]) == 0
    capfd.readouterr()
    step4 = out / "checkpoints" / "step_00000004"
    keep = tmp_path / "step4"
    shutil.copytree(step4, keep)
    then = ("move it aside (e.g. rename it step_00000004.damaged) to go back to "
            "step_00000002 (step 2)")
    meta = json.loads((step4 / "meta.json").read_text())
    del meta["model"]
    for damage, words, text in ((step4 / "rng" / "rank1.pt", "(rank 1: rng/rank1.pt: ", None),
                                (step4 / "rng" / "rank1.pt", "(rank 1: rng/rank1.pt: not a file "
                                 "of tensors that torch.load reads safely)", "not torch's"),
                                (step4 / "__1_0.distcp", "(rank ", None),
                                (step4 / ".metadata", "(.metadata is not checkpoint metadata "
                                 "(UnpicklingError: pickle data was truncated))", None),
                                (step4 / "meta.json", "(meta.json: ", ""),
                                (step4 / "meta.json", "(meta.json: no model)", json.dumps(meta))):
        damage.write_bytes(damage.read_bytes()[:10] if text is None else text.encode())
        line = _one_line(capfd, [*common, "--steps", "6", "--resume"])
        assert line.startswith(f"distllm train: error: checkpoint {step4} is damaged {words}")
        assert line.endswith(then), line
        shutil.rmtree(step4)
        shutil.copytree(keep, step4)
    # as the line says: renamed, it is no checkpoint, and the run resumes from step 2
    (step4 / "meta.json").write_text("")
    step4.rename(step4.with_name("step_00000004.damaged"))
    assert main(["train", *common, "--steps", "6", "--resume"]) == 0
    assert "resumed from step 2" in capfd.readouterr().err
    assert [d.name for d in checkpoint.complete(out)] == ["step_00000002", "step_00000006"]


def test_a_save_that_cannot_write_is_one_line_naming_out(capsys, monkeypatch, tmp_path):
    """A checkpoint whose write fails (a full disk: torch.save's or DCP's) ended the run with
    a traceback naming neither the disk nor --out: one line, exit code 2, and the checkpoint
    before it stays whole and resumes."""
    import errno

    out = tmp_path / "run"
    common = ["--model", "tiny", "--eval-batches", "0", "--seq-len", "32", "--global-batch",
              "2", "--no-progress", "--out", str(out), "--steps", "4", "--save-every", "2"]
    real = torch.save

    def full(obj, f, *args, **kwargs):
        if "step_00000004" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full)
    assert main(["train", *common]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and re.fullmatch(
        rf"distllm train: error: --out {re.escape(str(out))}: saving the checkpoint of step 4 "
        r"failed \(rank 0: \[Errno 28\] No space left on device; [0-9.e+]+ MiB free on its "
        r"device\); the newest complete checkpoint, step 2, is whole: free space there \(then "
        r"--resume\), or pass another --out", line), line
    monkeypatch.setattr(checkpoint.torch, "save", real)
    assert main(["train", *common, "--resume"]) == 0
    assert "resumed from step 2" in capsys.readouterr().err


def test_keep_checkpoints_keeps_the_newest(capfd, tmp_path):
    """``--keep-checkpoints 2`` with a save every step: the two newest stay, and the run
    resumes from the newest."""
    from distllm.train import checkpoint

    out = tmp_path / "run"
    common = ["--nproc", "2", "--dp", "2", *TINY, "--global-batch", "4", "--out", str(out)]
    assert main(["train", *common, "--steps", "6", "--save-every", "1", "--stop-after", "4",
                 "--keep-checkpoints", "2"]) == 0
    names = sorted(d.name for d in (out / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000004"], names
    assert checkpoint.latest(out).name == "step_00000004"


def test_stop_after_says_whether_it_saved(capfd, tmp_path):
    """--stop-after saves there and says to resume; with --no-save it says nothing was
    saved (and the run's checkpoints, from --save-every, are what --resume can take)."""
    base = [*TINY, "--global-batch", "4", "--steps", "4", "--stop-after", "2"]
    assert main(["train", *base, "--out", str(tmp_path / "a")]) == 0
    assert "stopped after step 2 of 4 (--stop-after); continue with --resume" in \
        capfd.readouterr().err
    assert main(["train", *base, "--no-save", "--out", str(tmp_path / "b")]) == 0
    assert ("stopped after step 2 of 4 (--stop-after); nothing saved there (--no-save): "
            "--resume continues from an earlier checkpoint only (--save-every)"
            in capfd.readouterr().err)
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_prune_never_removes_the_newest_or_an_incomplete_save(tmp_path):
    from distllm.train import checkpoint

    for step in (1, 2, 3):
        _checkpoint_at(tmp_path, step)
    (tmp_path / "checkpoints" / ".tmp-step_00000004").mkdir()
    (tmp_path / "checkpoints" / "step_00000005").mkdir()  # no meta.json: not complete
    assert checkpoint.prune(tmp_path, 0) == []
    gone = checkpoint.prune(tmp_path, 1)
    assert [d.name for d in gone] == ["step_00000001", "step_00000002"]
    left = sorted(d.name for d in (tmp_path / "checkpoints").iterdir())
    assert left == [".tmp-step_00000004", "step_00000003", "step_00000005"], left


def test_resume_keeps_the_checkpoints_optimizer_settings(capsys, tmp_path):
    """A resume with other optimizer or schedule settings than the checkpoint's is refused,
    naming each flag (it silently changed them: a learning rate 5.7x higher the step after
    the resume); raising --steps trains on at the schedule's end instead of stretching the
    schedule under the steps already run; --override-optim takes this command's."""
    from distllm.train.config import OptimConfig, TrainConfig
    from distllm.train.trainer import lr_at

    out = tmp_path / "run"
    common = ["--model", "tiny", "--eval-batches", "0", "--seq-len", "32", "--global-batch",
              "2", "--no-progress", "--out", str(out)]
    assert main(["train", *common, "--steps", "4"]) == 0
    capsys.readouterr()
    saved = checkpoint.optim_settings(checkpoint.latest(out))
    assert saved == OptimConfig().schedule(4) and saved["lr_decay_steps"] == 4
    line = _err(capsys, [*common, "--steps", "8", "--resume", "--lr", "0.01",
                         "--weight-decay", "0"])
    assert line.endswith(
        "optimizer settings differ from those the checkpoint in --out " + str(out) + " was "
        "trained with: --lr 0.01 (the checkpoint's: 0.003), --weight-decay 0.0 (the "
        "checkpoint's: 0.1); pass the checkpoint's, or add --override-optim to train on with "
        "this command's"), line
    assert "--lr-decay-steps 6 (the checkpoint's: 4)" in _err(
        capsys, [*common, "--steps", "8", "--resume", "--lr-decay-steps", "6"])
    assert main(["train", *common, "--steps", "6", "--resume"]) == 0
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    end = OptimConfig().lr * OptimConfig().min_lr_ratio
    assert lrs[3:] == pytest.approx([end] * 3), lrs  # the 4-step schedule's end, held
    assert main(["train", *common, "--steps", "8", "--resume", "--override-optim"]) == 0
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    stretched = [lr_at(s, TrainConfig(steps=8)) for s in range(6, 8)]
    assert lrs[6:] == pytest.approx(stretched) and stretched[0] > end * 1.5, lrs


def test_resume_keeps_the_checkpoints_data(capsys, tmp_path):
    """A resume that reads other data than the checkpoint trained on is refused naming
    --data (forgetting --data went on silently on the default corpus, or from a tokenizer's
    ids to bytes); the same file by another path resumes where the loader stood;
    --override-data trains on with the new data from its start. A checkpoint that did not
    record its data is checked on the kind of its tokens."""
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i * 7 % 13}\n" for i in range(600))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.upper())
    out = tmp_path / "run"
    common = ["--model", "tiny", "--eval-batches", "0", "--seq-len", "32", "--global-batch",
              "2", "--no-progress", "--out", str(out)]
    a = str(tmp_path / "a.txt")
    assert main(["train", *common, "--steps", "2", "--data", a]) == 0
    capsys.readouterr()
    assert checkpoint.meta_of(checkpoint.latest(out))["data_source"] == a
    assert _err(capsys, [*common, "--steps", "4", "--resume"]).endswith(
        f"--resume: the checkpoint in --out {out} trained on --data {a}, this command reads "
        f"the default corpus (text, as bytes): pass --data {a}, or add --override-data to "
        f"train on with this command's data, from its start")
    b = str(tmp_path / "b.txt")
    assert f"this command reads --data {b} (text, as bytes): pass --data {a}," in _err(
        capsys, [*common, "--steps", "4", "--resume", "--data", b])
    other_path = str(tmp_path / "." / "a.txt")
    assert main(["train", *common, "--steps", "3", "--resume", "--data", other_path]) == 0
    meta = checkpoint.meta_of(checkpoint.latest(out))
    assert meta["data"]["index"] == 6 and meta["data_source"] == a, meta["data"]
    assert main(["train", *common, "--steps", "4", "--resume", "--data", b,
                 "--override-data"]) == 0
    meta = checkpoint.meta_of(checkpoint.latest(out))
    assert (meta["data"]["epoch"], meta["data"]["index"]) == (0, 2), meta["data"]
    assert meta["data_source"] == b
    capsys.readouterr()
    # a checkpoint of before the data was recorded: its kind of tokens decides
    meta_file = checkpoint.latest(out) / "meta.json"
    del meta["data_source"], meta["data_fingerprint"]  # (neither was recorded then)
    meta_file.write_text(json.dumps({**meta, "tokens": "ids"}))
    assert "trained on a tokenizer's ids, this command reads --data" in _err(
        capsys, [*common, "--steps", "5", "--resume", "--data", b])
    meta_file.write_text(json.dumps(meta))
    assert main(["train", *common, "--steps", "5", "--resume"]) == 0


def test_a_resume_writes_the_checkpoints_step_line_that_a_kill_lost(capsys, tmp_path):
    """A kill between a checkpoint and its step's metrics line (during the step's
    validation, say) lost the line for good: the resume started after it. The checkpoint
    keeps the line, and a resume writes it where it is missing."""
    out = tmp_path / "run"
    common = ["--model", "tiny", "--eval-batches", "0", "--seq-len", "32", "--global-batch",
              "2", "--no-progress", "--out", str(out), "--steps", "4"]
    assert main(["train", *common, "--stop-after", "2"]) == 0
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    metrics.write_text(lines[0] + "\n")  # as a kill after the checkpoint leaves it
    assert main(["train", *common, "--resume"]) == 0
    again = metrics.read_text().splitlines()
    assert [json.loads(x)["step"] for x in again] == [1, 2, 3, 4]
    assert json.loads(again[1]) == json.loads(lines[1])
    assert main(["train", *common, "--steps", "5", "--resume"]) == 0  # a line there: kept
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_a_checkpoint_records_the_positions_its_run_trained(capsys, tmp_path):
    """`distllm sample` keeps to the positions a run trained: its --seq-len (a resume keeps
    it); a checkpoint from before this was recorded counts them all."""
    out = tmp_path / "run"
    common = ["--model", "tiny", "--eval-batches", "0", "--global-batch", "2", "--no-progress",
              "--out", str(out)]

    def trained() -> int:
        return checkpoint.meta_of(checkpoint.latest(out))["trained_positions"]

    assert main(["train", *common, "--steps", "1", "--seq-len", "16"]) == 0
    assert trained() == 16
    assert main(["train", *common, "--steps", "2", "--seq-len", "16", "--resume"]) == 0
    assert trained() == 16
    meta_file = checkpoint.latest(out) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["trained_positions"]
    meta_file.write_text(json.dumps(meta))
    assert main(["train", *common, "--steps", "3", "--seq-len", "16", "--resume"]) == 0
    assert trained() == 128
    capsys.readouterr()


def test_deterministic_resume_is_exact_under_sequence_parallelism(capfd, tmp_path):
    """--deterministic pins overlap "auto" too: its trial in the step ran other schedules
    after a resume (they split the reduce-scatter differently), so a float32 run at tp2 with
    sequence parallelism resumed off the bits of the uninterrupted one."""
    common = ["--nproc", "2", "--tp", "2", "--sequence-parallel", "--deterministic",
              "--model", "tiny", "--eval-batches", "0", "--seq-len", "32", "--global-batch",
              "4", "--no-progress", "--timeout", "60", "--steps", "8", "--warmup-steps", "2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["train", *common, "--out", str(whole)]) == 0
    assert main(["train", *common, "--out", str(parts), "--stop-after", "4"]) == 0
    assert main(["train", *common, "--out", str(parts), "--resume"]) == 0
    capfd.readouterr()

    def norms(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["grad_norm"] for x in lines]

    assert norms(parts) == norms(whole)
    _, a, _ = checkpoint.read_layers(checkpoint.latest(whole))
    _, b, _ = checkpoint.read_layers(checkpoint.latest(parts))
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


@pytest.mark.parametrize("text,kind", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv "
     "operation to complete", "timeout"),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
     "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60012 milliseconds "
     "before timing out.", "timeout"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4212", "lost"),
    ("NCCL error in: ProcessGroupNCCL.cpp:2063, remote process exited or there was a network "
     "error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network "
     "error or a remote process exiting prematurely.", "lost"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", None),
])
def test_the_launcher_reads_gloo_and_nccl_failures_alike(text, kind):
    """A rank's collective error, as gloo and NCCL word it: a timeout, a lost peer, or
    another failure (the rank's own)."""
    from distllm.train.launch import lost_peer, timed_out

    exc = RuntimeError(text)
    got = "timeout" if timed_out(exc) else "lost" if lost_peer(exc) else None
    assert got == kind


def test_auto_resume_is_one_command_for_a_first_attempt_and_its_restarts(capfd, tmp_path):
    """The same command starts the run where --out holds no checkpoint, and resumes it where
    it holds one (here under --nproc's launcher, whose ranks run its decision); the resumed
    run's losses are the uninterrupted run's. With --resume too it is refused."""
    common = ["--nproc", "2", "--dp", "2", "--model", "tiny", "--eval-batches", "0",
              "--seq-len", "32", "--global-batch", "4", "--no-progress", "--timeout", "60",
              "--steps", "4", "--save-every", "2", "--dtype", "float64", "--deterministic"]
    out, whole = tmp_path / "run", tmp_path / "whole"
    assert main(["train", *common, "--out", str(out), "--auto-resume", "--stop-after",
                 "2"]) == 0
    assert "resumed" not in capfd.readouterr().err
    assert main(["train", *common, "--out", str(out), "--auto-resume"]) == 0
    assert "resumed from step 2" in capfd.readouterr().err
    assert main(["train", *common, "--out", str(whole)]) == 0
    capfd.readouterr()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [x["loss"] for x in lines] == [x["loss"] for x in ref]
    assert _one_line(capfd, [*common, "--out", str(out), "--auto-resume", "--resume"]) == (
        "distllm train: error: --auto-resume with --resume: give one (--auto-resume resumes "
        "when --out holds a checkpoint, and starts the run when it holds none)")
