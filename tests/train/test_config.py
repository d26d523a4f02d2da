"""Config checks that name the knob, the choices each field takes from the module that
implements it, and the conversions between ParallelConfig, the planner's Layout and
ParallelDims (no processes)."""

from __future__ import annotations

import re

import pytest
import torch

from distllm.dtypes import DTYPES
from distllm.models.config import CHECKPOINTING, VOCAB_PARALLEL
from distllm.parallel.mesh import ParallelDims
from distllm.parallel.pipeline.schedules import SCHEDULES
from distllm.parallel.tensor.layers import OVERLAP_MODES
from distllm.plan.layout import Layout
from distllm.train.config import TRAIN_DTYPES, ParallelConfig, TrainConfig, check_layout


@pytest.mark.parametrize("kw, words", [
    (dict(zero=4), "--zero 4: choose one of 0, 1, 2, 3"),
    (dict(schedule="x"), "--schedule 'x': choose one of gpipe, 1f1b, interleaved-1f1b, zb-h1"),
    (dict(tp=0), "--tp 0: it must be a positive integer"),
    (dict(pp=4, micro_batches=2), "--micro-batches 2 < --pp 4"),
    (dict(pp=2, zero=3, schedule="zb-h1"), "zero=3 with the zb-h1 schedule: .*--zero 2 or lower"),
    (dict(overlap="y"), "--overlap 'y': choose one of auto, chunked, none"),
    (dict(vocab_parallel="n"), "--vocab-parallel 'n': choose one of auto, on, off"),
    (dict(tp=2, sequence_parallel=True, vocab_parallel="off"),
     "vocab_parallel='off' .* use --vocab-parallel auto .*--sequence-parallel"),
])
def test_parallel_config_names_the_knob(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        ParallelConfig(**kw)


@pytest.mark.parametrize("kw, words", [
    (dict(dtype="float16"), "--dtype 'float16': choose one of float32, bfloat16, float64"),
    (dict(activation_checkpointing="some"), "--activation-checkpointing 'some': choose one of "
                                            "none, selective, full"),
])
def test_train_config_names_the_knob(kw, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**kw)


@pytest.mark.parametrize("kw, words", [
    (dict(weight_decay=float("nan")), "--weight-decay nan: it must be finite and >= 0"),
    (dict(weight_decay=float("inf")), "--weight-decay inf: it must be finite and >= 0"),
    (dict(eps=0.0), "--eps 0.0: it must be finite and > 0"),
    (dict(grad_clip=float("nan")), "--grad-clip nan: use 0 to disable, or a positive finite"),
    (dict(lr=float("inf")), "--lr inf: it must be a positive finite number"),
    (dict(beta2=1.0), "--beta2 1.0: choose a value in [0, 1)"),
])
def test_optim_config_refuses_what_ruins_a_run(kw, words):
    """Values that would turn the weights to NaN in the first step and save them."""
    from distllm.train.config import OptimConfig

    with pytest.raises(ValueError, match=re.escape(words)):
        OptimConfig(**kw)


@pytest.mark.parametrize("kw, words", [
    (dict(timeout_s=float("inf")), "--timeout inf: it must be at least 1 s"),
    (dict(timeout_s=float("inf")), "default), at most 1e+08"),
    (dict(timeout_s=1e15), "--timeout 1000000000000000.0: it must be at least 1 s"),
    (dict(timeout_s=float("nan")), "--timeout nan: it must be at least 1 s"),
    (dict(timeout_s=0.001), "--timeout 0.001: it must be at least 1 s"),
    (dict(bucket_cap_mb=float("inf")), "--bucket-cap-mb inf: it must be a finite size"),
])
def test_parallel_config_refuses_what_overflows(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ParallelConfig(**kw)


@pytest.mark.parametrize("kw, words", [
    (dict(steps=10, warmup_steps=1000), "--warmup-steps 1000: the warm-up must end before the "
     "learning-rate schedule's last step (--steps 10); lower --warmup-steps below 10, or "
     "raise --steps"),
    (dict(steps=10, warmup_steps=10), "(--steps 10); lower --warmup-steps below 10"),
    (dict(steps=300, lr_decay_steps=5, warmup_steps=8), "--warmup-steps 8: the warm-up must "
     "end before the learning-rate schedule's last step (--lr-decay-steps 5); lower "
     "--warmup-steps below 5, or raise --lr-decay-steps"),
])
def test_a_warmup_as_long_as_the_schedule_is_refused(kw, words):
    """A warm-up that fills the schedule leaves the decay no step: the run trained at a
    fraction of --lr throughout (--warmup-steps 1000 --steps 10: 1%), or rose to --lr and
    dropped to its decay's end after the schedule (--lr-decay-steps 5 --warmup-steps 8)."""
    from distllm.train.config import OptimConfig

    steps = kw.pop("steps")
    with pytest.raises(ValueError, match=re.escape(words)):
        TrainConfig(steps=steps, optim=OptimConfig(**kw))


@pytest.mark.parametrize("steps, kw", [
    (10, dict(warmup_steps=9)),  # one step of decay, to lr * min_lr_ratio
    (300, dict(lr_decay_steps=10, warmup_steps=9)),
    (1, dict()),  # -1: 5% of the steps, at least 1: a one-step run warms up in it
    (1, dict(warmup_steps=0)),
    (300, dict()),  # make train's
])
def test_a_warmup_shorter_than_the_schedule_is_taken(steps, kw):
    from distllm.train.config import OptimConfig

    TrainConfig(steps=steps, optim=OptimConfig(**kw))


def test_an_empty_out_is_refused():
    with pytest.raises(ValueError, match="--out '': name the run's folder"):
        TrainConfig(out="")


@pytest.mark.parametrize("seed", [-1, 2**32, 99999999999999])
def test_a_seed_is_32_bits(seed):
    with pytest.raises(ValueError, match=rf"--seed {seed}: choose a seed in \[0, 2\*\*32\)"):
        TrainConfig(seed=seed)
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1


def test_choices_come_from_the_implementing_modules():
    assert set(TRAIN_DTYPES) <= set(DTYPES)
    for f, want in (("schedule", SCHEDULES), ("overlap", OVERLAP_MODES),
                    ("vocab_parallel", VOCAB_PARALLEL)):
        assert ParallelConfig.__dataclass_fields__[f].metadata["choices"] is want
    fields = TrainConfig.__dataclass_fields__
    assert fields["activation_checkpointing"].metadata["choices"] is CHECKPOINTING
    assert fields["dtype"].metadata["choices"] is TRAIN_DTYPES


def test_layout_checks():
    cfg = TrainConfig(parallel=ParallelConfig(tp=2, pp=2), global_batch=8)
    assert check_layout(cfg, 8, n_layers=4, n_heads=4, hidden=128, seq_len=32) == 2
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        check_layout(cfg, 6, n_layers=4, n_heads=4, hidden=128, seq_len=32)
    with pytest.raises(ValueError, match="--n-layers"):
        check_layout(TrainConfig(parallel=ParallelConfig(pp=8)), 8, n_layers=4, n_heads=4,
                     hidden=128, seq_len=32)


LAYOUTS = [
    Layout(2, 1, 4),
    Layout(1, 2, 2, 1, "gpipe", 3, "full"),
    Layout(2, 2, 2, 2, "1f1b", 4, "selective", True),
    Layout(1, 4, 1, 3, "interleaved-1f1b", 8, "none", False, 3),
    Layout(1, 2, 1, 2, "zb-h1", 2),
]


@pytest.mark.parametrize("lay", LAYOUTS, ids=[lay.name() for lay in LAYOUTS])
def test_layout_to_config_and_back(lay):
    world = lay.tp * lay.pp * lay.dp
    p = ParallelConfig.from_layout(lay)
    assert (p.tp, p.pp, p.dp, p.zero, p.micro_batches, p.sequence_parallel) == (
        lay.tp, lay.pp, lay.dp, lay.zero, lay.micro_batches, lay.sequence_parallel)
    assert p.chunks_per_rank == lay.virtual_stages
    cfg = TrainConfig(parallel=p, activation_checkpointing=lay.checkpointing)
    assert Layout.from_config(cfg, world) == lay
    dims = ParallelDims.from_layout(p, world_size=world)
    assert (dims.tp, dims.pp, dims.dp) == (lay.tp, lay.pp, lay.dp)


def test_from_layout_keeps_what_a_layout_does_not_decide():
    base = ParallelConfig(schedule="gpipe", overlap="chunked", bucket_cap_mb=4.0, timeout_s=9.0,
                          virtual_stages=5)
    p = ParallelConfig.from_layout(Layout(2, 1, 2, 1, "none", 2), base)
    assert (p.schedule, p.overlap, p.bucket_cap_mb, p.timeout_s, p.virtual_stages) == (
        "gpipe", "chunked", 4.0, 9.0, 5)
    q = ParallelConfig.from_layout(Layout(1, 2, 2, 0, "1f1b", 2), base)
    assert q.schedule == "1f1b" and q.virtual_stages == 5 and q.chunks_per_rank == 1


def test_from_config_resolves_dp_and_names_a_bad_world():
    cfg = TrainConfig(parallel=ParallelConfig(tp=2, dp=-1))
    assert Layout.from_config(cfg, 6) == Layout(2, 1, 3, 0, "none", 1)
    with pytest.raises(ValueError, match="world size 5 is not divisible by tp\\*pp=2"):
        Layout.from_config(cfg, 5)


def test_engine_refuses_a_batch_its_micro_batches_do_not_divide():
    """At pp=1 as at pp > 1: 6 sequences in 4 micro-batches is an error naming the knob (not
    three uneven chunks averaged as four)."""
    from distllm.train.engine import Engine

    cfg = TrainConfig(model="tiny", parallel=ParallelConfig(micro_batches=4), n_layers=1,
                      seq_len=8, global_batch=6, dtype="float64")
    eng = Engine(cfg, cfg.model_config(), ParallelDims())
    x = torch.zeros(6, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"6 samples, not divisible by --micro-batches=4"):
        eng.forward_backward(x, x)


def test_engine_builds_the_model_with_the_configured_vocabulary_split(monkeypatch):
    """The engine hands ``vocab_parallel`` to every GPT chunk it builds (a parity run with
    ``vp="on"`` would otherwise test the default split without saying so)."""
    import distllm.train.engine as engine_mod

    seen = []

    class Stop(Exception):
        pass

    def fake_gpt(cfg, dims, **kw):
        seen.append(kw.get("vocab_parallel"))
        raise Stop

    monkeypatch.setattr(engine_mod, "GPT", fake_gpt)
    for choice in ("on", "off"):
        cfg = TrainConfig(model="tiny", parallel=ParallelConfig(vocab_parallel=choice))
        with pytest.raises(Stop):
            engine_mod.Engine(cfg, cfg.model_config(), ParallelDims())
    assert seen == ["on", "off"]
