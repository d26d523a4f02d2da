"""``distllm train`` bad input: one clear line on stderr and exit code 2, checked before any
rank starts (and a checkpoint of another model refused at --resume)."""

from __future__ import annotations

import os

import pytest

from distllm.cli import main
from distllm.testing import run_distributed
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
    (["--lr", "-1"], "lr=-1.0"),
    (["--pp", "2", "--schedule", "zb-h1", "--activation-checkpointing", "full"], "zb-h1"),
])
def test_bad_input(capsys, argv, words):
    assert words in _err(capsys, argv)


def test_empty_data(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in _err(capsys, ["--data", str(tmp_path / "empty.txt")])
    (tmp_path / "folder").mkdir()
    assert "no text files" in _err(capsys, ["--data", str(tmp_path / "folder")])


def test_nproc_limit_is_cores_times_four(capsys):
    assert f"1..{_cores() * 4}" in _err(capsys, ["--nproc", str(_cores() * 4 + 1)])


def test_resume_refuses_another_model(capsys, corpus, tmp_path):
    out = tmp_path / "run"
    run_distributed(train_many, 1, [dict(steps=1, n_layers=2, save_final=True, out=str(out))],
                    corpus, str(tmp_path), timeout=300)
    line = _err(capsys, ["--resume", "--out", str(out), "--data", corpus, "--seq-len", "32"])
    assert "different model" in line and "n_layers: checkpoint 2 vs run 4" in line
    assert "no complete checkpoint" in _err(capsys, ["--resume", "--out", str(tmp_path / "x")])
