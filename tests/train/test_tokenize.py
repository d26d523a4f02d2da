"""``distllm tokenize``: text as a tokenizer's ids in the ``train.bin`` / ``val.bin`` that
``--data`` reads, equal to the ids of each whole file; and ``--init-from`` refusing text (read
as bytes) for a model that reads a tokenizer's ids, naming the command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from distllm.cli import main
from distllm.train.data import _held_out, load_corpus


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer as GPT-2's (its pre-tokenizer and regex, an end-of-text
    token), 1,000 ids learnt from the corpus: enough merges that a newline run is one token
    ("\\n\\n" at the end of a piece is one id, two in the whole text), so that a piece cut
    in the wrong place changes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([Path(corpus).read_text()], trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = GPT2TokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                            model_max_length=1024)  # as GPT-2's
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def texts(corpus, tmp_path_factory) -> Path:
    """A folder of three text files, cut from the corpus at arbitrary points."""
    text = Path(corpus).read_text()
    folder = tmp_path_factory.mktemp("texts")
    for i, (a, b) in enumerate([(0, 70_000), (70_000, 71_013), (71_013, 200_000)]):
        (folder / f"part{i}.txt").write_text(text[a:b])
    return folder


def test_the_ids_are_each_whole_files_then_end_of_text(texts, tok_dir, tmp_path):
    from distllm.train.tokenize_data import _pieces, tokenize_to_bins

    tok = _tokenizer(tok_dir)
    eos = tok.eos_token_id
    want = []
    for f in sorted(texts.iterdir()):
        want += tok(f.read_text(), add_special_tokens=False)["input_ids"] + [eos]
    # pieces of 200 characters at least (Python's sources have few cut points: a line that
    # starts a statement at the margin after one that is not blank): 28 in the third file
    got = tokenize_to_bins(str(texts), str(tmp_path / "ids"), str(tok_dir), val_fraction=0.1,
                           chunk_chars=200)
    n_val = _held_out(len(want), 0.1)
    assert got == {"train": len(want) - n_val, "val": n_val, "dtype": "uint16",
                   "vocab": 1000, "files": 3}
    train = np.fromfile(tmp_path / "ids" / "train.bin", dtype="<u2")
    val = np.fromfile(tmp_path / "ids" / "val.bin", dtype="<u2")
    assert len(val) == n_val and train.tolist() + val.tolist() == want
    pieces = list(_pieces(texts / "part2.txt", 200))
    assert len(pieces) > 20 and "".join(pieces) == (texts / "part2.txt").read_text()
    # --data reads it: the same ids, the train and validation parts as written
    c = load_corpus(str(tmp_path / "ids"))
    assert c.train.tolist() == train.tolist() and c.val.tolist() == val.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_cut_anywhere_they_may_give_the_whole_texts_ids(tok_dir, tmp_path, seed):
    """Random text of words, numbers, punctuation, contractions and every kind of white space
    (Unicode's too, and \\x1c, which only Python calls space), read in pieces of 5
    characters or more: each cut where the pre-tokenizer splits anyway."""
    import random

    from distllm.train.tokenize_data import _pieces

    rng = random.Random(seed)
    alphabet = (["word", "é", "中文", "12", ".", "'s", "'t", "(", "x"] * 3
                + [" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u3000",
                   "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u200b"])
    text = "".join(rng.choice(alphabet) for _ in range(6000))
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode())
    pieces = list(_pieces(f, 5))
    assert "".join(pieces) == text and len(pieces) > 500
    tok = _tokenizer(tok_dir)
    got = [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]
    assert got == tok(text, add_special_tokens=False)["input_ids"]


def test_a_file_of_one_line_streams_in_pieces(tok_dir, tmp_path):
    """Paragraphs separated by blank lines, or no newline at all: cut at the spaces."""
    from distllm.train.tokenize_data import _pieces

    f = tmp_path / "one.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    pieces = list(_pieces(f, 1000))
    assert len(pieces) == 18 and all(len(p) < 1100 for p in pieces)


def test_a_vocabulary_past_65536_writes_uint32(corpus, tok_dir, tmp_path, capfd):
    tok = _tokenizer(tok_dir)
    tok.add_tokens([f"zz{i}" for i in range(65_000)])
    tok.save_pretrained(tmp_path / "big")
    tiny = tmp_path / "t.txt"
    tiny.write_text("def zz64999(x):\n    return x\n" * 200)
    assert main(["tokenize", str(tiny), str(tmp_path / "ids"), "--tokenizer",
                 str(tmp_path / "big")]) == 0
    said = capfd.readouterr().out.strip()
    assert said.endswith(f"(uint32, a 66,000-token vocabulary, 1 file); train with --data "
                         f"{tmp_path / 'ids'} --data-dtype uint32"), said
    ids = np.fromfile(tmp_path / "ids" / "train.bin", dtype="<u4").tolist() + \
        np.fromfile(tmp_path / "ids" / "val.bin", dtype="<u4").tolist()
    assert ids == tok(tiny.read_text(), add_special_tokens=False)["input_ids"] + [0]
    assert 65_999 in ids  # an added token's id, past uint16


def test_text_that_spells_end_of_text_is_text(tok_dir, tmp_path):
    """The string "<|endoftext|>" inside a file is tokenized as text: only the file's end
    gets the end-of-text id (a false document boundary otherwise)."""
    from distllm.train.tokenize_data import tokenize_to_bins

    tok = _tokenizer(tok_dir)
    text = "x = '<|endoftext|>'\n" * 50
    (tmp_path / "a.txt").write_text(text)
    tokenize_to_bins(str(tmp_path / "a.txt"), str(tmp_path / "ids"), str(tok_dir))
    ids = np.concatenate([np.fromfile(tmp_path / "ids" / f, dtype="<u2")
                          for f in ("train.bin", "val.bin")]).tolist()
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
    assert ids[:-1] == tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def test_another_pre_tokenizer_gets_each_file_whole(corpus, texts, tmp_path):
    """A SentencePiece-style tokenizer (``Metaspace``: a piece begins as a new text) is not
    cut: the ids are each whole file's at any chunk size (cut, they were not)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from distllm.train.tokenize_data import _pieces, cuts_are_exact, tokenize_to_bins

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator([Path(corpus).read_text()], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    tok.save_pretrained(tmp_path / "sp")
    tok = _tokenizer(tmp_path / "sp")
    assert not cuts_are_exact(tok)
    whole = tok((texts / "part2.txt").read_text(), add_special_tokens=False)["input_ids"]
    cut = [i for p in _pieces(texts / "part2.txt", 200)
           for i in tok(p, add_special_tokens=False)["input_ids"]]
    assert cut != whole  # what cutting would have done
    tokenize_to_bins(str(texts / "part2.txt"), str(tmp_path / "ids"), str(tmp_path / "sp"),
                     chunk_chars=200)
    ids = np.concatenate([np.fromfile(tmp_path / "ids" / f, dtype="<u2")
                          for f in ("train.bin", "val.bin")]).tolist()
    assert ids == whole  # no end-of-text token: this tokenizer has none


@pytest.mark.parametrize("added", ["spaces", "word"])
def test_added_tokens_that_are_not_special_get_each_file_whole(tok_dir, tmp_path, added):
    """GPT-2's pre-tokenizer with added tokens that are not special (runs of spaces, as
    CodeGen's; a word): they are matched before the pre-tokenizer, whatever
    split_special_tokens says, so a cut changes the ids (a run of spaces cut in two, or the
    spaces before an added word split), and the file is tokenized whole (cut, the ids were
    not the whole file's)."""
    import random

    from tokenizers import AddedToken

    from distllm.train.tokenize_data import _pieces, cuts_are_exact, tokenize_to_bins

    tok = _tokenizer(tok_dir)
    assert cuts_are_exact(tok)  # GPT-2's, no added token but the special end-of-text
    tok.add_tokens([AddedToken(" " * k, normalized=False, special=False) for k in range(2, 6)]
                   if added == "spaces" else ["return"])
    tok.save_pretrained(tmp_path / "tok")
    tok = _tokenizer(tmp_path / "tok")
    assert not cuts_are_exact(tok)
    rng = random.Random(0)
    words = ["def", "x", "return", "if", "else", "foo", "(", ")", ":"]
    text = "".join(rng.choice(words) + " " * rng.randint(1, 5) + rng.choice(["", "\n", "\n\n"])
                   for _ in range(3000))
    (tmp_path / "a.txt").write_text(text)
    whole = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    cut = [i for p in _pieces(tmp_path / "a.txt", 50)
           for i in tok(p, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    assert cut != whole  # what cutting would have done
    tokenize_to_bins(str(tmp_path / "a.txt"), str(tmp_path / "ids"), str(tmp_path / "tok"),
                     chunk_chars=50)
    ids = np.concatenate([np.fromfile(tmp_path / "ids" / f, dtype="<u2")
                          for f in ("train.bin", "val.bin")]).tolist()
    assert ids == whole + [tok.eos_token_id]


def test_a_failed_write_is_one_line_naming_dest_and_leaves_nothing(tok_dir, tmp_path, capsys,
                                                                   monkeypatch):
    """A write that fails (a full disk) ended distllm tokenize in an OSError's traceback."""
    import errno
    import os

    from distllm.train import tokenize_data

    (tmp_path / "a.txt").write_text("print('hello')\n" * 100)
    real = open

    class Full:  # a file on a full disk: every write fails
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f

    monkeypatch.setattr(tokenize_data, "open", open_, raising=False)
    dest = tmp_path / "ids"
    assert main(["tokenize", str(tmp_path / "a.txt"), str(dest), "--tokenizer",
                 str(tok_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distllm tokenize: error: DEST {dest}: cannot write there (No space left on device); "
        f"free some space, or pass another DEST"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_tokenizing_says_nothing_on_a_text_past_the_models_length(tok_dir, tmp_path):
    """transformers warns once per tokenizer of ids "longer than the specified maximum
    sequence length" (1024 here): a corpus is not a model input, and the warning stays out."""
    import logging

    from transformers.utils import logging as tf_logging

    from distllm.train.tokenize_data import tokenize_to_bins

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = tf_logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        (tmp_path / "a.txt").write_text("def f(x):\n    return x\n" * 400)
        tokenize_to_bins(str(tmp_path / "a.txt"), str(tmp_path / "ids"), str(tok_dir))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("case,says", [
    ("no-src", "SRC {tmp}/none: no such file or folder"),
    ("no-tokenizer", "--tokenizer {tmp}: no tokenizer there (none of tokenizer.json, "
                     "tokenizer_config.json, vocab.json, tokenizer.model); pass a folder a "
                     "Hugging Face tokenizer's save_pretrained wrote"),
    ("not-utf8", "SRC {tmp}/texts: {tmp}/texts/b.txt is not UTF-8 text (invalid continuation "
                 "byte); convert it, or leave it out"),
    ("dest", "DEST {tmp}/full exists; pass a new folder"),
    ("fraction", "--val-fraction 1.5: choose a share between 0 and 1"),
    ("short", "SRC {tmp}/texts: 4 token ids leave 2 for train.bin, fewer than the 64 distllm "
              "train needs; pass more text"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tok_dir, tmp_path, capsys, case, says):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("print('hello')\n" * 100)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    src, dest, tok, extra = tmp_path / "texts", tmp_path / "d", tok_dir, []
    if case == "no-src":
        src = tmp_path / "none"
    elif case == "no-tokenizer":
        tok = tmp_path
    elif case == "not-utf8":
        (tmp_path / "texts" / "b.txt").write_bytes(b"caf\xe9\n")
    elif case == "dest":
        dest = tmp_path / "full"
    elif case == "short":  # (train refused what tokenize wrote)
        (tmp_path / "texts" / "a.txt").write_text("hi\n")
    else:
        extra = ["--val-fraction", "1.5"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["tokenize", str(src), str(dest), "--tokenizer", str(tok), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distllm tokenize: error: {says.format(tmp=tmp_path)}"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no leftovers
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


# --- --init-from: text is bytes, which only a model of bytes reads ---------------------------

def _gpt2_config(path: Path, **extra) -> Path:
    """A GPT-2 124M folder's config.json alone (what the checks before the weights read)."""
    from transformers import GPT2Config

    GPT2Config(**extra).save_pretrained(path)
    return path


def test_init_from_refuses_text_for_a_tokenizers_model(corpus, tok_dir, tmp_path, capsys):
    from tests.train.test_cli import _err

    hf = _gpt2_config(tmp_path / "gpt2")
    base = ["--model", "gpt2-small", "--init-from", str(hf), "--out", str(tmp_path / "run")]
    line = _err(capsys, [*base, "--data", corpus])
    assert line.endswith(
        f"--init-from {hf}: its model reads a tokenizer's ids (a 50,257-token vocabulary), and "
        f"--data {corpus} is text, which distllm reads as bytes: write the text's ids with "
        f"`distllm tokenize {corpus} OUT --tokenizer TOKENIZER` (TOKENIZER: a folder holding "
        f"the model's tokenizer, as its save_pretrained writes it) and pass --data OUT"), line
    _tokenizer(tok_dir).save_pretrained(hf)  # the folder holds its tokenizer: named
    line = _err(capsys, ["--nproc", "2", *base])  # the default corpus, found before a rank
    assert line.endswith(
        f"and without --data the run trains on text (the standard library's sources), which "
        f"distllm reads as bytes: write the text's ids with `distllm tokenize SRC OUT "
        f"--tokenizer {hf}` and pass --data OUT"), line
    assert not (tmp_path / "run").exists()


def test_init_from_takes_ids_or_a_model_of_bytes(corpus, tmp_path):
    """Token ids pass for any model; text passes for a model of 256 ids at most, or one that
    ``distllm export`` wrote from a run on text (``test_export`` checks it says so)."""
    from distllm.train.tokenize_data import check_pretrained_tokens

    (np.arange(5000) % 300).astype(np.uint16).tofile(tmp_path / "ids.bin")
    hf = _gpt2_config(tmp_path / "gpt2")
    check_pretrained_tokens(str(hf), 50257, str(tmp_path / "ids.bin"))
    check_pretrained_tokens(str(hf), 256, corpus)
    ours = _gpt2_config(tmp_path / "ours", distllm_tokens="bytes")
    check_pretrained_tokens(str(ours), 50257, corpus)
    check_pretrained_tokens(str(ours), 50257, None)
    for vocab in (50257, 256):  # what export recorded decides, also for a small vocabulary
        with pytest.raises(ValueError, match="its model reads a tokenizer's ids"):
            check_pretrained_tokens(str(_gpt2_config(tmp_path / f"x{vocab}",
                                                     distllm_tokens="ids")), vocab, corpus)


def test_train_refuses_it_before_building_the_model(tmp_path):
    """``train`` itself (torchrun, or a script), before the 124M model is built."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    hf = _gpt2_config(tmp_path / "gpt2")
    cfg = dataclasses.replace(make_cfg(None, str(tmp_path / "run"), init_from=str(hf)),
                              model="gpt2-small")
    with pytest.raises(ValueError, match=r"--init-from .*: its model reads a tokenizer's ids "
                                         r".* without --data the run trains on text"):
        train(cfg)
