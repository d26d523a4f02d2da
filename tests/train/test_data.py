"""Data, tokenizer and learning-rate schedule (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from distllm.train.config import TrainConfig
from distllm.train.data import BatchLoader, ByteTokenizer, load_corpus
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
