"""GPTConfig arithmetic (no processes)."""

from __future__ import annotations

import pytest

from distllm.models.gpt import GPTConfig, splits_vocab


def test_vocabulary_padded_to_64_per_tp_rank():
    assert [GPTConfig(vocab_size=256).padded_vocab(tp) for tp in (1, 2, 4, 8)] == [
        256, 256, 256, 512]
    assert [GPTConfig(vocab_size=123).padded_vocab(tp) for tp in (1, 2, 3)] == [128, 128, 192]


def test_small_vocabulary_is_held_whole_under_tp():
    # auto: split unless vocab * (tp - 1) <= 2 * hidden; one rank always "splits" (the same
    # modules)
    assert splits_vocab(256, 128, tp=2) is False
    assert splits_vocab(257, 128, tp=2) is True
    assert splits_vocab(256, 128, tp=4) is True
    assert splits_vocab(256, 384, tp=4) is False
    assert splits_vocab(256, 768, tp=2) is False
    assert splits_vocab(50257, 768, tp=4) is True
    assert splits_vocab(51200, 25600, tp=8) is True
    assert splits_vocab(256, 128, tp=1, choice="off") is True
    assert splits_vocab(50257, 768, tp=2, choice="off") is False
    assert splits_vocab(256, 128, tp=2, choice="on") is True
    # sequence parallelism keeps the split; asking for the whole one there names the knobs
    assert splits_vocab(256, 128, tp=2, sequence_parallel=True) is True
    with pytest.raises(ValueError, match="--vocab-parallel auto.*--sequence-parallel"):
        splits_vocab(256, 128, tp=2, sequence_parallel=True, choice="off")
    with pytest.raises(ValueError, match="vocab_parallel='sometimes'"):
        splits_vocab(256, 128, tp=2, choice="sometimes")
