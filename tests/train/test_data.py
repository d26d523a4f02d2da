"""Data, tokenizer and learning-rate schedule (no processes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distllm.train.config import TrainConfig
from distllm.train.data import (
    SCAN_IDS,
    BatchLoader,
    ByteTokenizer,
    check_vocab,
    load_corpus,
    tokens_of,
)
from distllm.train.shuffle import BLOCK, Permutation
from distllm.train.trainer import lr_at


def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * 7\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert tok.decode(ids) == text


def test_tokenizer_empty_text():
    tok = ByteTokenizer()
    for empty in ("", b""):
        ids = tok.encode(empty)
        assert ids.dtype == torch.int64 and ids.shape == (0,)
        assert tok.decode(ids) == ""


def test_tokenizer_decodes_an_id_past_the_bytes_as_a_replacement_character():
    """An id outside 0..255 (a model of a larger vocabulary) is no byte: U+FFFD, as for bytes
    that are not UTF-8 (it was masked to its low byte: 300 wrote a comma)."""
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 300, 33, -1, 0xC3, 0xA9]) == "hi\ufffd!\ufffdé"
    assert tok.decode(torch.tensor([0xC3, 256, 0xA9, 10])) == "\ufffd\ufffd\ufffd\n"


def test_default_corpus_is_the_stdlib_and_deterministic():
    a, b = load_corpus(None), load_corpus(None)
    assert a.source == "python-stdlib" and a.n_files > 100
    assert torch.equal(a.train[:10000], b.train[:10000]) and torch.equal(a.val, b.val)
    assert len(a.val) >= 0.02 * (len(a.train) + len(a.val)) - 1
    assert b"import" in bytes(a.train[:200000].tolist())


def test_loader_splits_the_global_batch_over_dp():
    tokens = torch.arange(10_000) % 251
    one = BatchLoader(tokens, seq_len=7, global_batch=6, dp=1, seed=3)
    parts = [BatchLoader(tokens, seq_len=7, global_batch=6, dp=3, dp_rank=r, seed=3)
             for r in range(3)]
    for _ in range(250):  # crosses an epoch boundary (1428 windows / 6 per batch)
        x, y = one.next()
        xs, ys = zip(*(p.next() for p in parts), strict=True)
        assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert one.epoch == 1


def test_loader_resumes_mid_epoch():
    tokens = torch.arange(5_000) % 97
    a = BatchLoader(tokens, seq_len=5, global_batch=4, seed=1)
    for _ in range(37):
        a.next()
    state = a.state_dict()
    want = [a.next() for _ in range(5)]
    b = BatchLoader(tokens, seq_len=5, global_batch=4, seed=1)
    b.load_state_dict(state)
    for (x, y), (u, v) in zip(want, (b.next() for _ in range(5)), strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)
    c = BatchLoader(tokens, seq_len=6, global_batch=4, seed=1)
    with pytest.raises(ValueError, match="--seq-len 5"):
        c.load_state_dict(state)


def test_loader_refuses_too_little_data():
    with pytest.raises(ValueError, match="--global-batch"):
        BatchLoader(torch.arange(50), seq_len=10, global_batch=8)


# --- pre-tokenized .bin files ----------------------------------------------------------

def _ids(n: int, top: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, top, n)


@pytest.mark.parametrize("dtype,top", [("uint16", 50257), ("uint32", 128256)])
def test_a_token_file_is_memory_mapped_and_split_as_text_is(tmp_path, dtype, top):
    ids = _ids(300_000, top)
    ids.astype(dtype).tofile(tmp_path / "tokens.bin")
    c = load_corpus(str(tmp_path / "tokens.bin"), dtype=dtype)
    assert isinstance(c.train, np.memmap) and c.n_files == 1
    n_val = int(len(ids) * 0.02)  # the text split: 2%, at least min(half, 4096)
    assert np.array_equal(c.train, ids[:-n_val]) and np.array_equal(c.val, ids[-n_val:])
    # the loader hands out the same batches as from the ids in memory
    a = BatchLoader(c.train, seq_len=31, global_batch=6, dp=2, dp_rank=1, seed=5, vocab_size=top)
    b = BatchLoader(torch.from_numpy(ids[:-n_val]), seq_len=31, global_batch=6, dp=2,
                    dp_rank=1, seed=5)
    for _ in range(20):
        (x, y), (u, v) = a.next(), b.next()
        assert x.dtype == torch.int64 and torch.equal(x, u) and torch.equal(y, v)


def test_a_folder_of_train_and_val_bin(tmp_path):
    _ids(10_000, 1000, 1).astype("uint16").tofile(tmp_path / "train.bin")
    _ids(3_000, 1000, 2).astype("uint16").tofile(tmp_path / "val.bin")
    for path in (tmp_path, tmp_path / "train.bin"):  # the folder, or its train.bin
        c = load_corpus(str(path))
        assert len(c.train) == 10_000 and len(c.val) == 3_000 and c.n_files == 2
        assert np.array_equal(c.val, _ids(3_000, 1000, 2))


def test_a_token_file_is_known_by_its_suffix_in_any_case(tmp_path):
    """``--data ids.BIN`` trained on the bytes of its ids, read as text."""
    ids = _ids(10_000, 1000, 3)
    ids.astype("uint16").tofile(tmp_path / "ids.BIN")
    assert tokens_of(str(tmp_path / "ids.BIN")) == "ids"
    c = load_corpus(str(tmp_path / "ids.BIN"))
    assert isinstance(c.train, np.memmap) and c.n_files == 1
    assert np.array_equal(np.concatenate([c.train, c.val]), ids)


def test_an_empty_val_bin_is_refused(tmp_path):
    _ids(10_000, 1000, 1).astype("uint16").tofile(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="val.bin is empty; fill it, or remove it"):
        load_corpus(str(tmp_path))


def test_token_files_refuse_what_they_cannot_read(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 1001)
    with pytest.raises(ValueError, match="1001 bytes, not a whole number of uint16 token ids; "
                                         "check --data-dtype"):
        load_corpus(str(tmp_path / "odd.bin"))
    (tmp_path / "short.bin").write_bytes(b"\0" * 20)
    with pytest.raises(ValueError, match="holds 10 token ids, too few to train on"):
        load_corpus(str(tmp_path / "short.bin"))


def test_ids_past_the_vocabulary_are_refused_naming_the_model():
    ids = np.full(1000, 300, dtype=np.uint16)  # the tiny model has 256 ids
    loader = BatchLoader(ids, seq_len=9, global_batch=4, vocab_size=256)
    with pytest.raises(ValueError, match="token ids beyond the model's vocabulary of 256 ids: "
                                         "choose a --model"):
        loader.next()


def test_check_vocab_reads_the_start_of_each_part(tmp_path):
    ids = np.zeros(SCAN_IDS + 5000, dtype=np.uint16)
    ids[SCAN_IDS + 10] = 999  # past the scan: left to the loader
    ids.tofile(tmp_path / "train.bin")
    val = np.zeros(100, dtype=np.uint16)
    val.tofile(tmp_path / "val.bin")
    check_vocab(load_corpus(str(tmp_path)), 256, "tiny")
    val[99] = 256
    val.tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match=r"--data .*: token id 256 is beyond the vocabulary of "
                                         r"--model tiny \(256 ids\): choose a --model"):
        check_vocab(load_corpus(str(tmp_path)), 256, "tiny")


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100)
    lrs = [lr_at(s, cfg) for s in range(100)]
    warm = 5  # 5% of the steps
    assert lrs[0] == pytest.approx(cfg.optim.lr / warm)
    assert lrs[warm - 1] == pytest.approx(cfg.optim.lr)
    assert all(a >= b for a, b in zip(lrs[warm - 1:], lrs[warm:], strict=False))
    assert lrs[-1] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio)
    mid = warm - 1 + (100 - warm) // 2
    assert lrs[mid] < cfg.optim.lr and not math.isnan(lrs[mid])


@pytest.mark.parametrize("schedule", ["linear", "constant", "wsd"])
def test_other_lr_schedules(schedule):
    from distllm.train.config import OptimConfig

    cfg = TrainConfig(steps=100, optim=OptimConfig(lr=1.0, min_lr_ratio=0.1,
                                                   lr_schedule=schedule, decay_fraction=0.2))
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # the same warm-up
    if schedule == "constant":
        assert lrs[5:] == [1.0] * 95
    elif schedule == "linear":  # as the cosine: 1.0 at step 5, 0.1 at step 99, straight
        assert lrs[5:] == pytest.approx([1.0 - 0.9 * (s - 5) / 94 for s in range(5, 100)])
    else:  # stable to step 80, then linear to 0.1 at step 99 (as linear is from its start)
        assert lrs[5:81] == [1.0] * 76
        assert lrs[80:] == pytest.approx([1.0 - 0.9 * k / 19 for k in range(20)])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_a_decay_of_one_step_ends_at_the_minimum(schedule):
    """Two steps, one of warm-up: the one step left is the decay's last, at lr x
    min_lr_ratio (it ran at the peak lr: the decay had no step to reach its end)."""
    from distllm.train.config import OptimConfig

    o = OptimConfig(lr=1.0, min_lr_ratio=0.1, lr_schedule=schedule, warmup_steps=1)
    assert [lr_at(s, TrainConfig(steps=2, optim=o)) for s in range(2)] == pytest.approx(
        [1.0, 0.1])


def test_wsd_decaying_all_steps_is_linear():
    from distllm.train.config import OptimConfig

    def lrs(schedule):
        o = OptimConfig(lr=1.0, lr_schedule=schedule, decay_fraction=1.0, warmup_steps=0)
        return [lr_at(s, TrainConfig(steps=10, optim=o)) for s in range(10)]

    assert lrs("wsd") == pytest.approx(lrs("linear"))
    assert lrs("wsd")[0] == 1.0


def test_decay_fraction_is_a_share():
    from distllm.train.config import OptimConfig

    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="--decay-fraction"):
            OptimConfig(decay_fraction=bad)


def test_an_unreadable_file_of_a_folder_is_refused_naming_it(tmp_path, monkeypatch):
    """A folder's file that cannot be read was left out of the corpus without a word."""
    from pathlib import Path

    (tmp_path / "a.txt").write_text("a" * 200)
    (tmp_path / "b.txt").write_text("b" * 200)
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "b.txt":  # (mode 000 does not stop root)
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(FileNotFoundError, match=f"--data {tmp_path}: cannot read "
                                                f"{tmp_path / 'b.txt'} \\(Permission denied\\)"):
        load_corpus(str(tmp_path))


@pytest.mark.parametrize("denied", ["list", "enter"])
def test_a_folder_that_cannot_be_read_is_refused_naming_it(tmp_path, monkeypatch, capsys,
                                                           denied):
    """A subfolder of --data (or of distllm tokenize's SRC) that cannot be listed was left
    out of the corpus without a word; one that can be listed but not entered (its files'
    status denied) ended ``distllm train`` and ``distllm tokenize`` in a PermissionError's
    traceback. (Permission bits do not stop root: the calls are made to fail.)"""
    import os
    import re
    from pathlib import Path

    from distllm.cli import main

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("a" * 200)
    (data / "sub" / "b.txt").write_text("b" * 200)
    call, real = ("scandir", os.scandir) if denied == "list" else ("stat", os.stat)
    where = data / "sub" if denied == "list" else data / "sub" / "b.txt"

    def refused(path=".", *args, **kwargs):
        if Path(path) == where:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, refused)
    says = (f"cannot read {where} (Permission denied): make it readable or move it out of the "
            f"folder")
    with pytest.raises(ValueError, match=f"^{re.escape(f'--data {data}: {says}')}$"):
        load_corpus(str(data))
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--data", str(data), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"distllm train: error: --data {data}: {says}"]
    assert main(["tokenize", str(data), str(tmp_path / "ids"), "--tokenizer", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"distllm tokenize: error: SRC {data}: {says}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_the_fingerprint_of_a_token_file_reads_its_ids(tmp_path):
    """:func:`check_same_data`'s fingerprint of memory-mapped ids: the same for the same ids
    in another file, another for one id changed in a slice it reads."""
    from distllm.train.data import fingerprint as _fingerprint

    ids = _ids(50_000, 1000, 4).astype("uint16")
    for name in ("a.bin", "b.bin"):
        ids.tofile(tmp_path / name)
    a, b = (_fingerprint(load_corpus(str(tmp_path / n))) for n in ("a.bin", "b.bin"))
    assert a == b and a[0] == 45_904 and a[2] == 4096  # (at least 4096 held out)
    ids[45_904 - 1] += 1  # the training part's last id
    ids.tofile(tmp_path / "b.bin")
    b = _fingerprint(load_corpus(str(tmp_path / "b.bin")))
    assert b[0] == a[0] and b[1] != a[1] and b[2:] == a[2:]


def test_each_epoch_hands_out_every_window_once_in_its_own_order():
    """Batches of 6 over 1428 windows of 7 tokens: an epoch hands out 1428 // 6 * 6 distinct
    windows (the ragged tail dropped), the next epoch the same windows in another order."""
    loader = BatchLoader(torch.arange(10_000), seq_len=7, global_batch=6, seed=3)
    epochs: list[list[int]] = [[], []]
    while True:
        x, _ = loader.next()
        if loader.epoch == 2:
            break
        epochs[loader.epoch] += (x[:, 0] // 7).tolist()  # window w starts at token 7w
    assert len(epochs[0]) == len(epochs[1]) == 1428 // 6 * 6
    assert len(set(epochs[0])) == len(epochs[0]) and set(epochs[0]) <= set(range(1428))
    assert len(set(epochs[1])) == len(epochs[1]) and epochs[0] != epochs[1]


def test_a_loader_saved_before_the_order_was_recorded_goes_on_in_its_order():
    """A checkpoint's loader state without "order" shuffled with torch.randperm seeded by
    (seed, epoch): the resumed loader hands out the rest of that order, then the next epoch
    in the same way; a restart (other data) takes the table-free order."""
    n, b = 85_714, 6  # windows past one block: the new order is no table
    state = {"epoch": 1, "index": 60, "seed": 3, "global_batch": b, "seq_len": 7}
    loader = BatchLoader(torch.arange(600_000), seq_len=7, global_batch=b, seed=3)
    loader.load_state_dict(state)
    assert loader.state_dict()["order"] == "table"
    want = torch.randperm(n, generator=torch.Generator().manual_seed(3 * 1_000_003 + 1))
    x, _ = loader.next()
    assert torch.equal(x[:, 0] // 7, want[60:66])
    loader.index = n // b * b  # the epoch's last batch handed out: the next epoch, alike
    loader.next()
    x, _ = loader.next()
    want = torch.randperm(n, generator=torch.Generator().manual_seed(3 * 1_000_003 + 2))
    assert torch.equal(x[:, 0] // 7, want[6:12])
    assert not torch.equal(Permutation(n, 3 * 1_000_003).range(0, 6), want[:6])
    loader.restart()
    assert loader.state_dict()["order"] == "permutation"
    x, _ = loader.next()
    assert torch.equal(x[:, 0] // 7, Permutation(n, 3 * 1_000_003).range(0, 6))


def test_the_shuffle_holds_no_table_of_every_window():
    """A permutation of 2**40 items (a corpus far past memory) answers a batch at once; each
    block of positions it computes is a permutation's part: distinct items, all below n."""
    p = Permutation(2**40, seed=5)
    at = 2**39 + 12_345
    got = p.range(at, at + 8)
    assert torch.equal(got, p(torch.arange(at, at + 8)))
    block = p.range(BLOCK * 3, BLOCK * 4)
    assert block.unique().numel() == BLOCK and int(block.max()) < 2**40
    for n in (1, 2, 3, 7, 1000, 65_537):  # every size: a permutation of range(n)
        q = Permutation(n, seed=n)
        assert torch.equal(q(torch.arange(n)).sort().values, torch.arange(n)), n
        assert torch.equal(torch.cat([q.range(i, min(i + 5, n)) for i in range(0, n, 5)]),
                           q(torch.arange(n))), n
    with pytest.raises(IndexError):
        p(torch.tensor([2**40]))
    for q in (p, Permutation(1000, seed=1)):  # a position tensor of any shape; range bounds
        assert torch.equal(q(torch.tensor(3)), q(torch.tensor([3]))[0])
        assert q(torch.tensor(3)).shape == () and q(torch.arange(6).view(2, 3)).shape == (2, 3)
        for lo, hi in ((q.n - 2, q.n + 3), (5, 3), (-1, 2)):
            with pytest.raises(IndexError):
                q.range(lo, hi)
    # the loader over 2**40 windows (one token repeated: no memory): its first batch
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint16), (2**40 * 8 + 1,), (0,))
    x, y = BatchLoader(huge, seq_len=8, global_batch=4, seed=1).next()
    assert x.shape == y.shape == (4, 8) and not x.any()
