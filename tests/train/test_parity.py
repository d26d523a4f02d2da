"""The parity matrix: every layout's per-step losses equal the single-process run (float64).

All runs use the ``tiny`` GPT, seq 32, global batch 8, the same seed and the trainer's
default optimizer settings (AdamW with weight decay on matrices only, global-norm clipping,
linear warm-up then cosine decay): a parity test that turns a feature off cannot see that
feature's bugs. The learning-rate schedule is that of a 60-step run stopped after 3 steps
(``stop_after``), so each layout compares with the first 3 steps of the reference; the
weights each layout saves after its last step (whole, read back from its sharded checkpoint)
equal the reference's after 3 steps, so the last update is checked too. One spawn
per world size trains its layouts one after the other (a module-scoped fixture); each layout
is its own test. The default selection takes one representative of each pair; ``-m full``
runs all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distllm.testing import DistributedFailure, run_distributed
from tests.train._util import SEED, train_many

STEPS = 3
TOL = 1e-12  # float64: layouts differ only in summation order (all-reduce, micro-batching)
TOL_BF16 = 2e-3  # bf16 compute, fp32 masters: both bf16 layouts within 5e-4 of float64 (4x)
WTOL = 1e-10  # the last weights, absolute (they are about 0.02 to 1; measured: 3e-14)
# bf16: the last weights' distance from float64's, over the distance float64's moved from
# the initial weights (2-norms over the model): 0.035 measured for both bf16 layouts; a
# missing last update would read about 0.4
WTOL_BF16 = 0.1
# float32 (the trainer's default dtype; its oneDNN GEMMs pinned): against float64, measured
# 1.3e-7 (losses, relative) and 2.7e-5 (weights, absolute: Adam's division by the square
# root of small second moments amplifies float32 rounding) in one process and every layout
TOL_F32, WTOL_F32 = 1e-6, 1e-4


def _id(kw: dict) -> str:
    return ".".join(f"{k}{v}" for k, v in kw.items())  # e.g. tp2.dp2.zero3


@pytest.fixture(scope="module")
def matrix(corpus, tmp_path_factory):
    """``matrix(name, world, layouts, kw)``: the per-step losses of layout ``kw``; the layouts
    of one ``name`` are trained once, in one spawn of ``world`` ranks (a failure is kept and
    reported by every test of that spawn rather than re-run)."""
    done: dict[str, list | Exception] = {}

    def get(name: str, world: int, layouts: list[dict], kw: dict) -> tuple[list[float], dict]:
        if name not in done:
            runs = [dict(steps=60, stop_after=STEPS, save_final=True, **r) for r in layouts]
            out = str(tmp_path_factory.mktemp(name))
            try:
                done[name] = (run_distributed(train_many, world, runs, corpus, out,
                                              timeout=600)[0], out)
            except DistributedFailure as e:
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        losses, out = done[name]
        i = layouts.index(kw)
        return losses[i], _weights(Path(out) / f"run{i}")

    return get


def _weights(run: Path) -> dict:
    """The whole weights of the checkpoint the run saved after its last step."""
    from distllm.train.checkpoint import read_layers

    return read_layers(run / "checkpoints" / f"step_{STEPS:08d}")[1]



@pytest.fixture(scope="module")
def deep_reference(corpus, tmp_path_factory) -> tuple[list[float], dict]:
    """The single-process losses and last weights of the 6-block model (pp4 with
    interleaving needs 8 chunks)."""
    out = tmp_path_factory.mktemp("deep")
    losses = run_distributed(train_many, 1, [dict(steps=60, stop_after=STEPS, n_layers=6,
                                                  save_final=True)],
                             corpus, str(out), timeout=300)[0][0]
    return losses, _weights(out / "run0")


def _check(kw: dict, got: tuple[list[float], dict], reference: list[float],
           weights: dict) -> None:
    losses, last = got
    bf16 = kw.get("dtype") == "bfloat16"
    f32 = kw.get("dtype") == "float32"
    tol = TOL_BF16 if bf16 else TOL_F32 if f32 else TOL
    assert len(losses) == STEPS, kw
    for step, (a, b) in enumerate(zip(losses, reference[:STEPS], strict=True)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{kw} step {step + 1}: {a} vs {b}"
    assert last.keys() == weights.keys(), kw
    for i, layer in weights.items():
        assert last[i].keys() == layer.keys(), (kw, i)
    if bf16:
        import torch

        from distllm.models import GPTConfig
        from distllm.models.sharding import init_canonical

        mcfg = GPTConfig.preset("tiny", **{k: v for k, v in kw.items() if k == "n_layers"})
        off = moved = 0.0
        for i, layer in weights.items():
            init = init_canonical(mcfg, i, SEED, torch.float64)
            for name, want in layer.items():
                off += float((last[i][name].double() - want).square().sum())
                moved += float((want - init[name]).square().sum())
        assert moved > 1.0 and (off / moved) ** 0.5 <= WTOL_BF16, (kw, off, moved)
        return
    for i, layer in weights.items():
        for name, want in layer.items():
            diff = float((last[i][name].double() - want).abs().max())
            assert diff <= (WTOL_F32 if f32 else WTOL), (
                f"{kw} layer {i} {name}: max difference {diff:.3g}")


def test_reference_learns(reference):
    # the parity checks compare something that moves between steps (they are not vacuous)
    assert reference[STEPS - 1] < reference[0] - 0.1


# the tiny vocabulary (256 = 2 x hidden) is held whole under TP by default (vp="auto"); the
# layouts with vp="on" split it as a large vocabulary is (sequence parallelism always does)
DEFAULT_2 = [
    dict(tp=2, overlap="chunked"),
    dict(tp=2, vp="on", m=2),  # accumulation under TP (the vocabulary-parallel loss each time)
    dict(pp=2, schedule="1f1b", m=2),
    dict(dp=2, zero=2),
    dict(dp=2, zero=3),
    dict(tp=2, sp=True, overlap="none"),
    dict(tp=2, activation_checkpointing="full"),
    dict(tp=2, bs=2, overlap="auto"),  # batch-split overlap in training (auto splits eval only)
    dict(pp=2, schedule="interleaved-1f1b", m=2, activation_checkpointing="selective"),
    dict(tp=2, dtype="bfloat16"),
    dict(dp=2, zero=1, dtype="bfloat16"),
    dict(dp=2, m=2),  # gradient accumulation without a pipeline (DDP's no_sync)
    dict(tp=2, zero=3, sp=True, activation_checkpointing="selective"),  # ZeRO at dp 1
    dict(pp=2, schedule="gpipe", m=2),
    dict(dp=2, zero=2, m=2),  # ZeRO-2's sharded gradients accumulated over micro-batches
]
DEFAULT_4 = [
    dict(tp=2, pp=2, schedule="1f1b", m=2, sp=True, overlap="chunked"),
    dict(tp=2, dp=2, zero=3, sp=True, m=2),  # with SP and accumulation (FULL_4: each stage)
    dict(tp=2, dp=2, zero=2, vp="on"),
    dict(pp=2, dp=2, schedule="zb-h1", m=2, zero=1),
    dict(tp=4, overlap="auto"),
    dict(tp=2, dp=2, bs=3),  # batch split under DDP, 4 sequences a rank in 3 parts
    dict(pp=2, dp=2, schedule="interleaved-1f1b", m=4, zero=3),
    dict(pp=2, dp=2, schedule="interleaved-1f1b", m=4, zero=2),
    dict(tp=2, pp=2, schedule="zb-h1", m=2, vp="on", bs=2),  # batch split in a stage
    dict(tp=2, pp=2, schedule="1f1b", m=2, bs=2, overlap="chunked"),
]


@pytest.mark.parametrize("kw", DEFAULT_2, ids=_id)
def test_parity_two_ranks(matrix, reference, reference_weights, kw):
    _check(kw, matrix("default2", 2, DEFAULT_2, kw), reference, reference_weights)


@pytest.mark.parametrize("kw", DEFAULT_4, ids=_id)
def test_parity_four_ranks(matrix, reference, reference_weights, kw):
    _check(kw, matrix("default4", 4, DEFAULT_4, kw), reference, reference_weights)


def _train_with_backend(backend: str, runs: list[dict], data: str, out: str):
    """Rank function: :func:`train_many` with every ``auto`` choice of the fused Linear+GeLU
    op made ``backend`` (its choice is timed, so either may run in the matrix above); the
    losses of each run, and the op's call sites that asked (``linear_gelu`` forward/backward,
    or its whole call)."""
    from distllm.ops import backend_choice

    real, asked = backend_choice.choose, set()

    def choose(key, device, candidates, grad=False):
        if key.startswith("linear_gelu"):
            assert backend in candidates, (key, list(candidates))
            asked.add(key.split("|")[0])
            return backend
        return real(key, device, candidates, grad)

    backend_choice.choose = choose
    try:
        return train_many(runs, data, out), sorted(asked)
    finally:
        backend_choice.choose = real


# the layouts whose MLP runs the fused op differently: split over TP under sequence
# parallelism, its weight gradients deferred (zb-h1), its weights gathered per use (ZeRO-3)
FORCED = [dict(tp=2, sp=True, overlap="chunked"), dict(pp=2, schedule="zb-h1", m=2),
          dict(dp=2, zero=3)]


@pytest.fixture(scope="module")
def forced(corpus, tmp_path_factory):
    done = {}

    def get(backend: str, kw: dict):
        if backend not in done:
            runs = [dict(steps=60, stop_after=STEPS, save_final=True, **r) for r in FORCED]
            out = tmp_path_factory.mktemp(f"forced-{backend}")
            done[backend] = (run_distributed(_train_with_backend, 2, backend, runs, corpus,
                                             str(out), timeout=600)[0], out)
        (losses, asked), out = done[backend]
        i = FORCED.index(kw)
        return losses[i], _weights(out / f"run{i}"), asked

    return get


@pytest.mark.parametrize("kw", FORCED, ids=_id)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_parity_with_each_fused_mlp_backend(forced, reference, reference_weights, backend, kw):
    """The fused Linear+GeLU on its CPU backend (oneDNN or torch's GEMM, GeLU fused in its
    passes) and on the unfused reference, each in the layouts that call it differently."""
    losses, last, asked = forced(backend, kw)
    assert asked, "the fused op was never asked for a backend: the test forces nothing"
    _check(kw, (losses, last), reference, reference_weights)


# float32, the dtype a user gets by default, whose GEMMs run through oneDNN where it is
# faster (float64 is torch's alone): pinned (--deterministic), so that oneDNN runs
FLOAT32 = [dict(tp=2, sp=True, overlap="chunked", dtype="float32", deterministic=True),
           dict(dp=2, zero=2, dtype="float32", deterministic=True),
           dict(pp=2, schedule="1f1b", m=2, dtype="float32", deterministic=True)]


@pytest.mark.parametrize("kw", FLOAT32, ids=_id)
def test_parity_float32(matrix, reference, reference_weights, kw):
    _check(kw, matrix("float32", 2, FLOAT32, kw), reference, reference_weights)


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
FULL_2 = (
    [dict(tp=2, sp=sp, overlap=ov) for sp in (False, True) for ov in ("none", "chunked")]
    + [dict(tp=2, vp="on", overlap=ov) for ov in ("none", "chunked")]
    + [dict(pp=2, schedule=s, m=4 if s == "interleaved-1f1b" else 2) for s in SCHEDULES]
    + [dict(pp=2, schedule="gpipe", m=1)]
    + [dict(dp=2, zero=z) for z in (0, 1, 2, 3)]
    + [dict(dp=2, zero=z, m=2) for z in (1, 2, 3)]
)
FULL_4 = (
    [dict(tp=4, sp=sp, overlap=ov) for sp in (False, True) for ov in ("none", "chunked")]
    + [dict(pp=4, schedule=s, m=4, n_layers=6 if s == "interleaved-1f1b" else 0)
       for s in SCHEDULES]
    + [dict(dp=4, zero=z) for z in (0, 1, 2, 3)]
    + [dict(tp=2, pp=2, schedule=s, m=4, sp=True) for s in SCHEDULES]
    + [dict(pp=2, dp=2, schedule="zb-h1", m=2, zero=z) for z in (0, 1, 2)]
    + [dict(pp=2, dp=2, m=2, zero=3)]
    + [dict(pp=2, dp=2, schedule="interleaved-1f1b", m=4, zero=z) for z in (0, 1)]
    + [dict(tp=2, dp=2, zero=z, vp=vp) for z in (0, 1, 2, 3) for vp in ("auto", "on")]
)


# tp, pp and dp all above 1: 8 ranks (about 25 s on two cores)
DEFAULT_8 = [dict(tp=2, pp=2, dp=2, schedule="1f1b", m=2, zero=1),
             dict(tp=2, pp=2, dp=2, schedule="interleaved-1f1b", m=4, zero=3, sp=True)]


@pytest.mark.parametrize("kw", DEFAULT_8, ids=_id)
def test_parity_eight_ranks(matrix, reference, reference_weights, kw):
    _check(kw, matrix("default8", 8, DEFAULT_8, kw), reference, reference_weights)


@pytest.mark.full
@pytest.mark.parametrize("kw", FULL_2, ids=_id)
def test_parity_full_two_ranks(matrix, reference, reference_weights, kw):
    _check(kw, matrix("full2", 2, FULL_2, kw), reference, reference_weights)


@pytest.mark.full
@pytest.mark.parametrize("kw", FULL_4, ids=_id)
def test_parity_full_four_ranks(matrix, reference, reference_weights, request, kw):
    ref, weights = (request.getfixturevalue("deep_reference") if kw.get("n_layers")
                    else (reference, reference_weights))
    _check(kw, matrix("full4", 4, FULL_4, kw), ref, weights)
