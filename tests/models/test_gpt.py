"""GPTConfig arithmetic (no processes)."""

from __future__ import annotations

from distllm.models.gpt import GPTConfig


def test_vocabulary_padded_to_64_per_tp_rank():
    assert [GPTConfig(vocab_size=256).padded_vocab(tp) for tp in (1, 2, 4, 8)] == [
        256, 256, 256, 512]
    assert [GPTConfig(vocab_size=123).padded_vocab(tp) for tp in (1, 2, 3)] == [128, 128, 192]
