"""``distllm export``: a checkpoint as a Hugging Face GPT-2 folder, read by one process at
any layout it was trained at; the folder computes the run's own validation loss."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distllm.cli import main
from distllm.testing import run_distributed

TOL = 1e-10  # float64


def _train_and_validate(corpus: str, out: str) -> float:
    """Rank function: 3 steps of tp2.pp2 in float64, saved, validated on 2 global batches."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    res = train(make_cfg(corpus, out, tp=2, pp=2, m=2, steps=3, save_final=True,
                         eval_batches=2))
    return res.val_loss


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("export") / "run"
    vals = run_distributed(_train_and_validate, 4, corpus, str(out), timeout=300)
    assert len(set(vals)) == 1 and vals[0] is not None
    return out, vals[0]


def test_the_export_computes_the_runs_validation_loss(corpus, trained, tmp_path, capsys):
    import torch
    from transformers import GPT2LMHeadModel

    from distllm.train.data import BatchLoader, load_corpus

    out, val_loss = trained
    assert main(["export", str(out), str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"distllm export: {out / 'checkpoints' / 'step_00000003'} -> "), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing else left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it
    # the run read text as bytes: --init-from then takes text for this model (test_tokenize)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["distllm_tokens"] == "bytes"
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert next(hf.parameters()).dtype == torch.float64  # the checkpoint's dtype
    val = BatchLoader(load_corpus(corpus).val, seq_len=32, global_batch=8, shuffle=False)
    losses = []
    with torch.no_grad():
        for _ in range(2):
            x, y = val.next()
            logits = hf(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                            y.reshape(-1)))
    assert abs(float(sum(losses) / 2) - val_loss) < TOL, (losses, val_loss)


def test_a_checkpoint_folder_and_its_step(trained, tmp_path, capsys):
    out, _ = trained
    step3 = out / "checkpoints" / "step_00000003"
    assert main(["export", str(step3), str(tmp_path / "a"), "--step", "3"]) == 0
    assert (tmp_path / "a" / "config.json").is_file()
    assert main(["export", str(out), str(tmp_path / "b"), "--step", "3"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()
    capsys.readouterr()


@pytest.mark.parametrize("args,says", [
    (["{tmp}/none", "{tmp}/d"], "RUN {tmp}/none: no such folder"),
    (["{tmp}", "{tmp}/d"], "RUN {tmp}: no complete checkpoint under {tmp}/checkpoints; pass a "
                           "training run's --out folder"),
    (["{out}", "{tmp}/d", "--step", "2"], "--step 2: RUN {out} has checkpoints of steps 3"),
    (["{out}", "{tmp}/full"], "DEST {tmp}/full exists; pass a new folder"),
])
def test_bad_input_is_one_line(trained, tmp_path, capsys, args, says):
    out, _ = trained
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    fill = dict(tmp=tmp_path, out=out)
    assert main(["export", *(a.format(**fill) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distllm export: error: {says.format(**fill)}"], err
    assert not (tmp_path / "d").exists()
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_a_failed_write_leaves_nothing(trained, tmp_path, monkeypatch):
    from distllm.models import hf as hf_mod

    out, _ = trained
    real = hf_mod.hf_from_layers

    def failing(cfg, layers):
        model = real(cfg, layers)

        def save_pretrained(path, **kw):
            (Path(path) / "config.json").write_text("{}")
            raise OSError("disk full")

        model.save_pretrained = save_pretrained
        return model

    monkeypatch.setattr(hf_mod, "hf_from_layers", failing)
    with pytest.raises(OSError, match="disk full"):
        main(["export", str(out), str(tmp_path / "d")])
    assert list(tmp_path.iterdir()) == []
