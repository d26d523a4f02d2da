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
    for f in (tmp_path / "hf").iterdir():  # as open makes them (the weights were 0600)
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
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
    (["{out}", "{tmp}/full/keep.txt/d"], "DEST {tmp}/full/keep.txt/d: cannot create a folder "
                                         "there ({tmp}/full/keep.txt is a file, not a folder); "
                                         "pass another DEST"),
    (["{out}", "{tmp}/full/keep.txt/a/d"], "DEST {tmp}/full/keep.txt/a/d: cannot create a "
                                           "folder there ({tmp}/full/keep.txt is a file, not a "
                                           "folder); pass another DEST"),
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


@pytest.mark.parametrize("command", ["export", "sample"])
def test_a_damaged_only_checkpoint_names_run(trained, tmp_path, capsys, command):
    """With no earlier checkpoint to go back to, the advice names what these commands take
    (RUN), not train's --out alone."""
    import shutil

    out, _ = trained
    run = tmp_path / "run"
    shutil.copytree(out / "checkpoints", run / "checkpoints")
    for meta in (run / "checkpoints").glob("step_*/meta.json"):
        meta.write_text("{")
    argv = [command, str(run)] + ([str(tmp_path / "hf")] if command == "export" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0] and err[0].endswith(
        "no earlier checkpoint is complete: resume another --out, or export or sample another "
        "RUN"), err


@pytest.mark.parametrize("command", ["export", "sample"])
def test_a_checkpoint_whose_model_has_an_unknown_field_is_one_line(trained, tmp_path, capsys,
                                                                   command):
    """A field of the model in meta.json that GPTConfig does not have (a newer distllm's, or
    a damaged file) was a TypeError's traceback."""
    import shutil

    out, _ = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    ckpt = max((run / "checkpoints").iterdir())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"]["foo"] = 1
    (ckpt / "meta.json").write_text(json.dumps(meta))
    argv = [str(run), str(tmp_path / "d")] if command == "export" else [str(run)]
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distllm {command}: error: {ckpt}: its meta.json's model is not a "
                   f"GPTConfig this distllm builds (GPTConfig.__init__() got an unexpected "
                   f"keyword argument 'foo'): a checkpoint of another distllm version, or a "
                   f"damaged meta.json"], err


@pytest.mark.parametrize(("command", "field", "value"), [
    ("export", "layer_norm_eps", -1.0), ("export", "tie_embeddings", "no"),
    ("sample", "init_std", float("nan"))])
def test_a_checkpoint_whose_model_has_a_bad_value_is_one_line(trained, tmp_path, capsys,
                                                              command, field, value):
    """A damaged meta.json's layer_norm_eps=-1.0 was exported as a model of NaN logits, and
    "tie_embeddings": "no" taken as true: refused, naming the field."""
    import shutil

    out, _ = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    ckpt = max((run / "checkpoints").iterdir())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"][field] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    argv = [str(run), str(tmp_path / "d")] if command == "export" else [str(run)]
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"distllm {command}: error: GPTConfig.{field}={value!r}: it must be "), err
    assert not (tmp_path / "d").exists()


def test_a_failed_write_leaves_nothing(trained, tmp_path, monkeypatch, capsys):
    """A write that fails (a full disk) is one line naming DEST, exit 2, and leaves no
    folder (it was a traceback)."""
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
    dest = tmp_path / "d"
    assert main(["export", str(out), str(dest)]) == 2
    assert capsys.readouterr().err == (f"distllm export: error: DEST {dest}: cannot write there "
                                       "(disk full); free some space, or pass another DEST\n")
    assert list(tmp_path.iterdir()) == []


def test_a_file_size_limit_is_one_line(trained, tmp_path):
    """The real thing, not a fake OSError: under a file-size limit the weights' writer
    (safetensors) raises its own error, not an OSError; still one line naming DEST, exit 2,
    nothing left. And DEST "." (the current folder) is refused in one line."""
    import resource
    import subprocess
    import sys

    out, _ = trained

    def limit():  # config.json fits, model.safetensors does not (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))

    dest = tmp_path / "d"
    cwd = tmp_path / "here"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "distllm", "export", str(out), str(dest)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"distllm export: error: DEST {dest}: cannot "
                                               f"write there ("), proc.stderr
    assert err[0].endswith("); free some space, or pass another DEST"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    proc = subprocess.run([sys.executable, "-m", "distllm", "export", str(out), "."],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("distllm export: error: DEST . is the current folder; pass a new "
                           "folder\n")
    assert list(cwd.iterdir()) == []


def test_the_new_folder_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
    """Every file and folder written into the temporary folder, then the folder itself, are
    synced to the device before it is renamed to DEST, and DEST's parent after: a crash
    leaves DEST whole or absent, never with empty files."""
    from distllm.train.new_folder import new_folder
    from tests.train._util import record_syncs

    events = record_syncs(monkeypatch)
    parent = tmp_path.resolve() / "out"
    with new_folder(parent / "d") as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"\0" * 8)
    assert (parent / "d" / "sub" / "weights.bin").read_bytes() == b"\0" * 8
    moved = events.index(("replace", str(tmp), str(parent / "d")))
    synced = [events.index(("fsync", str(p))) for p in (
        tmp / "config.json", tmp / "sub" / "weights.bin", tmp / "sub", tmp)]
    assert max(synced) < moved, events
    assert synced[1] < synced[2] < synced[3], events  # a file, then its name, then the folder's
    assert ("fsync", str(parent)) in events[moved + 1:], events


# --- distllm sample: the checkpoint's model continues a prompt --------------------------------

def test_sample_greedy_is_the_likeliest_token_each_step(trained, capsys):
    """Against a loop of the exported model's forward (no cache), argmax each step; top-k 1
    sampling is greedy at any temperature; a seed repeats its samples."""
    import torch

    from distllm.models.hf import hf_from_layers
    from distllm.train.checkpoint import read_layers
    from distllm.train.data import ByteTokenizer
    from distllm.train.sample import sample

    out, _ = trained
    ckpt = out / "checkpoints" / "step_00000003"
    hf = hf_from_layers(*read_layers(ckpt)[:2])
    ids = ByteTokenizer().encode("def f(x):\n").tolist()
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    want = ByteTokenizer().decode(ids)
    assert sample(ckpt, "def f(x):\n", max_new_tokens=24, temperature=0) == [want]
    assert sample(ckpt, "def f(x):\n", max_new_tokens=24, temperature=1.5, top_k=1) == [want]
    drawn = sample(ckpt, "def f(x):\n", max_new_tokens=24, num_samples=3, seed=5)
    assert len(drawn) == 3 and drawn == sample(ckpt, "def f(x):\n", max_new_tokens=24,
                                               num_samples=3, seed=5)
    assert all(d.startswith("def f(x):\n") for d in drawn) and drawn != [want] * 3
    assert main(["sample", str(out), "--prompt", "def f(x):\n", "--max-new-tokens", "24",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_many_samples_are_generated_a_batch_at_a_time(trained, capsys, monkeypatch):
    """Past SAMPLE_BATCH, the continuations come in batches (memory does not grow with
    --num-samples), the first SAMPLE_BATCH those of --num-samples SAMPLE_BATCH, and the
    command prints each batch as it comes."""
    from transformers import GPT2LMHeadModel

    from distllm.train import sample as sample_mod

    out, _ = trained
    ckpt = out / "checkpoints" / "step_00000003"
    monkeypatch.setattr(sample_mod, "SAMPLE_BATCH", 2)
    batches = []
    generate = GPT2LMHeadModel.generate

    def counted(self, input_ids, **kw):
        batches.append(len(input_ids))
        return generate(self, input_ids, **kw)

    monkeypatch.setattr(GPT2LMHeadModel, "generate", counted)
    five = sample_mod.sample(ckpt, "def ", max_new_tokens=6, num_samples=5, seed=3)
    assert batches == [2, 2, 1] and len(five) == 5 and len(set(five)) > 1
    assert sample_mod.sample(ckpt, "def ", max_new_tokens=6, num_samples=2, seed=3) == five[:2]
    # the sampling's random stream is its own: the caller's draws between the batches it
    # yields change nothing, and its random state is left as it was
    import torch

    torch.manual_seed(123)
    before = torch.get_rng_state()
    got = []
    for text in sample_mod.iter_samples(ckpt, "def ", max_new_tokens=6, num_samples=5, seed=3):
        got.append(text)
        assert torch.equal(torch.get_rng_state(), before)
        torch.rand(7)
        before = torch.get_rng_state()
    assert got == five
    capsys.readouterr()
    assert main(["sample", str(out), "--prompt", "def ", "--max-new-tokens", "6",
                 "--num-samples", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out == "\n\n---\n".join(five) + "\n"


@pytest.mark.parametrize("args,says", [
    (["--max-new-tokens", "200", "--prompt", "x" * 100],
     "--max-new-tokens 200: with the prompt's 100 tokens it passes the model's context of "
     "128; lower it, or shorten --prompt"),
    (["--prompt", ""], "--prompt is empty: give the model some text to continue"),
    (["--prompt", "x" * 200, "--max-new-tokens", "5"],
     "--prompt: its 200 tokens fill the model's context of 128; shorten it"),
    (["--temperature", "-1"], "--temperature -1.0: it must be 0 (greedy) or a finite positive "
                                 "number (0.8 is the default)"),
    (["--temperature", "nan"], "--temperature nan: it must be 0 (greedy) or a finite positive "
                                 "number (0.8 is the default)"),
    (["--temperature", "inf"], "--temperature inf: it must be 0 (greedy) or a finite positive "
                                 "number (0.8 is the default)"),
    (["--prompt", "ab\udcff"], "--prompt: it is not text that encodes as UTF-8 (surrogates "
                               "not allowed at character 2); give UTF-8 text"),
    (["--top-k", "-1"], "--top-k -1: it must be at least 0"),
    (["--seed", str(10**20)], f"--seed {10**20}: choose a seed in [0, 2**32)"),
    (["--step", "2"], "--step 2: RUN {out} has checkpoints of steps 3"),
    (["--tokenizer", "{tmp}"], "--tokenizer {tmp}: the run trained on text, as bytes; drop "
                               "--tokenizer"),
])
def test_sample_bad_input_is_one_line(trained, tmp_path, capsys, args, says):
    out, _ = trained
    fill = dict(tmp=tmp_path, out=out)
    assert main(["sample", str(out), *(a.format(**fill) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distllm sample: error: {says.format(**fill)}"], err


def test_a_temperature_near_0_is_refused_naming_0_as_greedy(tmp_path):
    """--temperature 1e-50 (0 in float32) ended in generate's "probability tensor contains
    either inf, nan" traceback; below 1e-4 sampling is greedy in effect. Checked before the
    checkpoint is read (1e-4 goes on to read it)."""
    import re

    from distllm.train.sample import sample

    for t in (1e-50, 9.9e-5):
        with pytest.raises(ValueError, match="^" + re.escape(
                f"--temperature {t}: below 0.0001 sampling is greedy in effect (near 0 the "
                f"logits divided by it overflow); pass 0 (greedy), or at least 0.0001") + "$"):
            sample(tmp_path, temperature=t)
    with pytest.raises(ValueError, match=f"^checkpoint {tmp_path} is damaged"):
        sample(tmp_path, temperature=1e-4)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_sample_of_bytes_takes_no_id_past_them(temperature):
    """A run on bytes with a vocabulary past 256 ids (a preset's padded one): the ids it
    never trained are no bytes, yet generate drew them (where the model, as here, favours
    them), and the tokenizer wrote their low byte."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from distllm.train.data import ByteTokenizer
    from distllm.train.sample import _codec, _generate

    encode, decode, eos, n_ids = _codec("bytes", 512, None)
    assert (eos, n_ids, decode.__func__) == (None, 256, ByteTokenizer.decode)
    assert _codec(None, 256, "bytes")[3] == 256
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=8, n_layer=1,
                                    n_head=2, tie_word_embeddings=False,
                                    bos_token_id=None, eos_token_id=None)).eval()
    with torch.no_grad():  # every id past the bytes far likelier than any byte
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[256:] = 1.0
        hf.transformer.ln_f.weight.zero_()
        hf.transformer.ln_f.bias.fill_(5.0)
    rows = list(_generate(hf, [10, 20], 8, lambda row: row, None, n_ids,
                          temperature=temperature, top_k=50, num_samples=3, seed=0))
    assert [len(r) for r in rows] == [10] * 3
    assert all(0 <= i < 256 for r in rows for i in r[2:]), rows


def _bpe_256(corpus: str, path: Path) -> Path:
    """A byte-level BPE tokenizer of 256 ids (the corpus's characters, then merges), which
    the 256-token model holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([Path(corpus).read_text()],
                           trainers.BpeTrainer(vocab_size=256, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(path)
    return path


def test_sample_writes_what_the_trained_positions_leave_by_default(trained, capsys):
    """At most 200 new tokens, fewer where the positions the run trained (its --seq-len, 32
    of the model's 128) end first, or the model's context after a longer prompt: the
    README's `distllm sample RUN` of `make train`'s run. Past the trained positions, a note."""
    from distllm.train.checkpoint import meta_of
    from distllm.train.sample import sample

    out, _ = trained
    ckpt = out / "checkpoints" / "step_00000003"
    assert meta_of(ckpt)["trained_positions"] == 32
    note = ("note: the run trained the first 32 of the model's 128 positions (its --seq-len); "
            "the tokens past them are at positions it never learnt\n")
    for prompt, new, said in (("\n", 31, ""), ("x" * 31, 1, ""), ("x" * 100, 28, note * 2)):
        assert sample(ckpt, prompt, temperature=0) == sample(ckpt, prompt, temperature=0,
                                                             max_new_tokens=new)
        assert capsys.readouterr().err == said
    with pytest.raises(ValueError, match="--max-new-tokens 29: with the prompt's 100 tokens"):
        sample(ckpt, "x" * 100, max_new_tokens=29)
    assert sample(ckpt, "\n", temperature=0, max_new_tokens=32)  # the model's context allows
    assert capsys.readouterr().err == note
    assert main(["sample", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out.strip() and not said.err


def test_sample_of_a_run_on_ids_decodes_with_its_tokenizer(corpus, trained, tmp_path):
    import json
    import shutil

    import torch
    from transformers import AutoTokenizer

    from distllm.models.hf import hf_from_layers
    from distllm.train.checkpoint import read_layers
    from distllm.train.sample import sample

    out, _ = trained
    ckpt = tmp_path / "step_00000003"
    shutil.copytree(out / "checkpoints" / "step_00000003", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "tokens": "ids"}))
    with pytest.raises(ValueError, match=r"^the run trained on a tokenizer's ids \(256-token "
                                         r"vocabulary\): pass its tokenizer with --tokenizer DIR"):
        sample(ckpt)
    tok_dir = _bpe_256(corpus, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 256
    hf = hf_from_layers(*read_layers(ckpt)[:2])
    ids = tok("import os\n", add_special_tokens=False)["input_ids"]
    n = len(ids)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert n < 10  # merged: not the prompt's bytes
    assert sample(ckpt, "import os\n", max_new_tokens=16, temperature=0,
                  tokenizer=str(tok_dir)) == [tok.decode(ids)]
    # a tokenizer's end-of-text token ends a sample: here the 4th new token's id
    end = ids[n + 3]
    eos_tok = AutoTokenizer.from_pretrained(tok_dir)
    eos_tok.eos_token = eos_tok.convert_ids_to_tokens(end)
    eos_tok.save_pretrained(tmp_path / "eos")
    assert sample(ckpt, "import os\n", max_new_tokens=16, temperature=0,
                  tokenizer=str(tmp_path / "eos")) == [tok.decode(ids[:ids.index(end, n) + 1])]
    # --tokenizer bytes reads this run as bytes (a checkpoint that did not record its tokens)
    as_bytes = sample(out / "checkpoints" / "step_00000003", "import os\n", max_new_tokens=4,
                      temperature=0)
    assert sample(ckpt, "import os\n", max_new_tokens=4, temperature=0,
                  tokenizer="bytes") == as_bytes
    with pytest.raises(ValueError, match=r"^--tokenizer .*tok: the run trained on text, as "
                                         r"bytes; drop --tokenizer"):
        sample(out / "checkpoints" / "step_00000003", tokenizer=str(tok_dir))
    tok.add_tokens(["more"])
    tok.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match=r"--tokenizer .*big: its 257 ids do not fit the "
                                         r"model's 256-token vocabulary; pass the run's "):
        sample(ckpt, tokenizer=str(tmp_path / "big"))


def test_a_sample_stops_at_its_first_end_of_text_after_the_prompt():
    """generate pads a sample that ended early with more end-of-text ids: they are cut."""
    from distllm.train.sample import _until_eos

    assert _until_eos([1, 9, 2, 3, 9, 4, 9, 9], 2, 9) == [1, 9, 2, 3, 9]
    assert _until_eos([9, 1, 2], 1, 9) == [9, 1, 2]
    assert _until_eos([1, 9, 9], 1, None) == [1, 9, 9]


@pytest.mark.parametrize("command", ["export", "sample"])
def test_without_transformers_it_is_one_line(trained, tmp_path, capsys, monkeypatch, command):
    import importlib.util

    out, _ = trained
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    args = [str(out), str(tmp_path / "d")] if command == "export" else [str(out)]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distllm {command}: error: distllm {command} needs the transformers package "
                   f"(pip install transformers)"], err


@pytest.mark.parametrize("empty_before", [False, True])
def test_a_dest_filled_by_another_command_meanwhile_is_one_line(tmp_path, empty_before):
    """Two exports into one new DEST at once: the second to finish found DEST filled by the
    first (its rmdir or its rename refused a folder with entries), a traceback; the first
    one's folder stays whole, and nothing of the second is left beside it."""
    from distllm.train.new_folder import new_folder

    dest = tmp_path / "hf"
    if empty_before:
        dest.mkdir()
    with pytest.raises(ValueError) as e:
        with new_folder(dest) as tmp:
            (tmp / "mine.txt").write_text("second")
            if empty_before:
                dest.rmdir()
            dest.mkdir()  # the other export, done first
            (dest / "theirs.txt").write_text("first")
    assert str(e.value) == f"DEST {dest} exists; pass a new folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert [p.name for p in dest.iterdir()] == ["theirs.txt"]
