"""The planner reads the rules it shares with the code from their one home: the vocabulary
padding from distllm's model, the dtype names from :mod:`distllm.dtypes`; the dtypes the
distllm runtime trains in are the trainer's."""

from __future__ import annotations

import pytest

from distllm.dtypes import ALIASES
from distllm.models import GPTConfig
from distllm.plan import load_profile, preset
from distllm.plan.model import ModelShape


@pytest.mark.parametrize("vocab", [1, 7, 123, 256, 769, 50257])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_vocabulary_padded_as_the_model_pads_it(vocab, tp):
    shape = ModelShape("custom", 2, 64, 4, 256, vocab, 16, 4)
    assert shape.padded_vocab(tp) == GPTConfig(vocab_size=vocab).padded_vocab(tp)


def test_gpt_presets_hold_the_models_embedding_rows():
    for name in ("tiny", "gpt2-small", "gpt2-xl"):
        mcfg = GPTConfig.preset(name)
        for tp in (1, 2, 4, 8):
            assert preset(name).padded_vocab(tp) == mcfg.padded_vocab(tp), (name, tp)


def test_an_explicit_multiple_still_applies():
    shape = ModelShape("custom", 2, 64, 4, 256, 50257, 16, 4, vocab_multiple=128)
    assert shape.padded_vocab(8) == 51200


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_profile_dtypes_accept_every_alias_of_distllm_dtypes(alias):
    prof = load_profile("a100-80gb")
    canonical = ALIASES[alias]
    if canonical in prof.peak_flops:
        assert prof.flops(alias) == prof.flops(canonical)
    else:
        with pytest.raises(ValueError, match="--dtype"):
            prof.flops(alias)


def test_an_unknown_training_dtype_names_the_knob():
    from distllm.plan import CostModel

    with pytest.raises(ValueError, match="--dtype"):
        CostModel(preset("tiny"), load_profile("cpu"), 4, 4, dtype="int8")


def test_the_distllm_runtime_trains_the_trainers_dtypes():
    from distllm.plan.runtime import runtime
    from distllm.train.config import TRAIN_DTYPES

    assert set(runtime("distllm").dtypes) == set(TRAIN_DTYPES)
