"""The validation loss: every layout's equals the single-process run's (float64), at each
``--eval-every`` step and after the last step, and validating does not change training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distllm.testing import run_distributed

TOL = 1e-10  # float64: the layouts differ in summation order only


def _train_validating(runs: list[dict], data: str, out: str) -> list[tuple]:
    """Rank function: train each of ``runs``; its losses and validation losses by step."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    done = []
    for i, kw in enumerate(runs):
        res = train(make_cfg(data, f"{out}/run{i}", **kw))
        done.append((res.losses, res.val_losses, res.val_loss))
    return done


MID = dict(steps=60, stop_after=4, eval_every=2, eval_batches=2)  # validates at 2 and 4
END = dict(steps=4, eval_batches=2)  # validates after its last step only
LAYOUTS = [
    dict(tp=2, pp=2, m=2, sp=True, **MID),
    dict(tp=2, dp=2, zero=3, vp="on", **MID),
    dict(pp=2, dp=2, schedule="interleaved-1f1b", m=2, **MID),
    dict(dp=4, zero=2, **END),
]


@pytest.fixture(scope="module")
def validated(corpus, tmp_path_factory):
    one = run_distributed(_train_validating, 1, [MID, END], corpus,
                          str(tmp_path_factory.mktemp("one")), timeout=300)[0]
    out = tmp_path_factory.mktemp("four")
    four = run_distributed(_train_validating, 4, LAYOUTS, corpus, str(out), timeout=600)[0]
    return {"MID": one[0], "END": one[1]}, four, out


def _close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("i", range(len(LAYOUTS)))
def test_validation_matches_one_process(validated, reference, i):
    ones, four, _ = validated
    kw = LAYOUTS[i]
    losses, vals, final = four[i]
    ref_losses, ref_vals, ref_final = ones["MID" if "eval_every" in kw else "END"]
    if "eval_every" in kw:
        assert sorted(vals) == [2, 4] and final is None and ref_final is None
        # validating every 2 steps leaves training as it was (the 6-step reference)
        for step, (a, b) in enumerate(zip(ref_losses, reference, strict=False)):
            _close(a, b, f"one process, step {step + 1}")
        assert ref_vals[4] < ref_vals[2] - 0.05  # it measures something that moves
    else:
        assert sorted(vals) == [4] and final == vals[4] and ref_final == ref_vals[4]
    assert sorted(vals) == sorted(ref_vals)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        _close(a, b, f"{kw} step {step + 1}")
    for step in vals:
        _close(vals[step], ref_vals[step], f"{kw} validation at step {step}")


def test_validation_goes_into_the_metrics_line(validated):
    _, _, out = validated
    lines = [json.loads(x) for x in Path(out, "run0", "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [("val_loss" in x) for x in lines] == [False, True, False, True]


def _train_on(datas: list[str], out: str) -> list[tuple]:
    """Rank function: the same dp2 ZeRO-1 run on each of ``datas``."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    done = []
    for i, data in enumerate(datas):
        res = train(make_cfg(data, f"{out}/run{i}", dp=2, zero=1, **END))
        done.append((res.losses, res.val_loss))
    return done


def test_a_token_file_trains_as_its_text_does(corpus, tmp_path):
    """The corpus's bytes written as uint16 token ids (nanoGPT's .bin) train to the same
    losses and validation loss as the text file itself: the same split, windows and batches."""
    import numpy as np

    ids = np.frombuffer(Path(corpus).read_bytes(), dtype=np.uint8).astype(np.uint16)
    ids.tofile(tmp_path / "corpus.bin")
    (text, text_val), (bins, bins_val) = run_distributed(
        _train_on, 2, [corpus, str(tmp_path / "corpus.bin")], str(tmp_path), timeout=300)[0]
    assert len(text) == 4 and text_val is not None
    assert bins == text and bins_val == text_val


def _failing_validation(corpus: str, out: str) -> str:
    """Rank function: a 3-step run saving at the end, whose validation raises."""
    import distllm.train.trainer as trainer
    from tests.train._util import make_cfg

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory in validation")

    trainer._validate = fails
    try:
        trainer.train(make_cfg(corpus, out, dp=2, steps=3, save_final=True, eval_batches=2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_failed_validation_keeps_the_steps_checkpoint_and_line(corpus, tmp_path):
    """The last step's checkpoint is written before its validation, and its metrics line
    is written when the validation fails."""
    out = tmp_path / "run"
    said = run_distributed(_failing_validation, 2, corpus, str(out), timeout=300)
    assert said == ["out of memory in validation"] * 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and "val_loss" not in lines[-1]


def _validate_small(data: str, out: str, layouts: list[dict]) -> list:
    """Rank function: a 2-step run of each of ``layouts`` on ``data``; its validation loss
    and what it printed."""
    import contextlib
    import io

    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        vals = [train(make_cfg(data, f"{out}/run{i}", steps=2, eval_batches=2, **kw)).val_loss
                for i, kw in enumerate(layouts)]
    return vals, said.getvalue()


def test_held_out_data_smaller_than_a_global_batch_validates(corpus, tmp_path):
    """6 held-out sequences, a global batch of 8: one batch of 6 (split over the DP ranks or
    the pipeline's micro-batches), the single-process figure on every layout; 1 sequence
    under dp2 is too few, and the run says so."""
    import numpy as np

    ids = np.frombuffer(Path(corpus).read_bytes(), dtype=np.uint8).astype(np.uint16)
    for name, n_val in (("six", 6 * 32 + 1), ("one", 32 + 1)):
        Path(tmp_path, name).mkdir()
        ids[:-4000].tofile(tmp_path / name / "train.bin")
        ids[-n_val:].tofile(tmp_path / name / "val.bin")
    one = run_distributed(_validate_small, 1, str(tmp_path / "six"), str(tmp_path / "a"),
                          [{}], timeout=300)[0][0][0]
    two = run_distributed(_validate_small, 2, str(tmp_path / "six"), str(tmp_path / "b"),
                          [dict(pp=2, m=2), dict(dp=2)], timeout=300)[0][0]
    assert one is not None and len(two) == 2
    for got in two:
        _close(got, one, "6 held-out sequences")
    none, said = run_distributed(_validate_small, 2, str(tmp_path / "one"),
                                 str(tmp_path / "c"), [dict(dp=2)], timeout=300)[0]
    assert none == [None]
    assert ("validation skipped: the held-out data holds 1 sequences of 32 tokens, fewer than "
            "one per data-parallel rank and micro-batch (2)") in said, said
