"""The trainer's peak FLOP/s for MFU: the hardware profiles' datasheet figures on known GPUs,
a measurement elsewhere (no processes, no GPU: the device is only named)."""

from __future__ import annotations

import pytest
import torch

from distllm.train import checkpoint, trainer

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_named(monkeypatch):
    def name(n: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: n)

    monkeypatch.setattr(trainer, "_measured_flops", lambda dtype, device: (1.0, "measured"))
    return name


@pytest.mark.parametrize("gpu, dtype, tf32, tflops", [
    # dense datasheet figures (NVIDIA H100 SXM, A100 SXM)
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989),
    ("NVIDIA H100 80GB HBM3", torch.float32, False, 67),
    ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7),
    ("NVIDIA H200", torch.float64, False, 67),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156),
    ("NVIDIA A100-SXM4-80GB", torch.float64, False, 19.5),
])
def test_known_gpus_read_their_profile(gpu_named, gpu, dtype, tf32, tflops):
    gpu_named(gpu)
    matmul = torch.backends.cuda.matmul  # its flags are not plain attributes: set and restore
    old, matmul.allow_tf32 = matmul.allow_tf32, tf32
    try:
        flops, how = trainer.peak_flops(dtype, CUDA)
    finally:
        matmul.allow_tf32 = old
    assert flops == pytest.approx(tflops * 1e12, rel=1e-12) and how.startswith("profile "), how


def test_an_unknown_gpu_and_the_cpu_are_measured(gpu_named):
    gpu_named("Tesla T4")
    assert trainer.peak_flops(torch.float32, CUDA) == (1.0, "measured")
    assert trainer.peak_flops(torch.float32, torch.device("cpu")) == (1.0, "measured")


def test_the_library_probes_leave_the_callers_random_state_as_it_was():
    """The CPU peak measurement and oneDNN's dtype probe run before a resumed run's first step:
    drawing from the global generator there would spend the random state the checkpoint
    restored."""
    from distllm.ops import cpu_gemm

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    trainer._measured_flops(torch.float32, torch.device("cpu"))
    cpu_gemm.onednn_dtype_ok.__wrapped__(torch.float32)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_drops_later_steps_and_a_torn_line_of_the_metrics(tmp_path):
    """A run killed after its checkpoint, or while writing a line (a full disk): the lines
    after the checkpoint's step go, and so does one cut short, which --resume choked on."""
    import json

    from distllm.train.trainer import _truncate_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(lines[:3]) + '\n{"step": 4, "lo\n\n' + lines[3])
    _truncate_metrics(str(path), 3)
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    path.write_text(lines[0] + "\n" + lines[1])  # the last line whole, its newline lost
    _truncate_metrics(str(path), 3)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    # a line an older run wrote with NaN, and a checkpoint's line with one: strict JSON now
    path.write_text('{"step": 1, "grad_norm": NaN}\n')
    _truncate_metrics(str(path), 2, {"step": 2, "loss": float("inf")})
    assert path.read_text() == '{"step": 1, "grad_norm": null}\n{"step": 2, "loss": null}\n'


def test_a_failed_rewrite_of_the_metrics_is_one_line_and_leaves_them(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl beside it; a full disk there was a traceback, and it
    left metrics.jsonl.tmp behind."""
    import errno
    import os

    from distllm.train.trainer import _truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(ValueError) as e:
        _truncate_metrics(str(path), 1)
    assert str(e.value) == (f"--out {tmp_path}: rewriting metrics.jsonl failed (No space left "
                            f"on device); it is as it was: free space there (then run again), "
                            f"or pass another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_the_python_api_resumes_as_the_command_does(corpus, tmp_path):
    """``train(cfg)`` with ``resume=True`` runs ``distllm train --resume``'s checks: raising
    ``steps`` trains on at the end of the checkpoint's schedule (the API stretched it to
    the new ``steps``), other data is refused naming --data (the API restarted the data
    silently), and so is a checkpoint at ``steps``; the caller's config is left as given."""
    import json
    from pathlib import Path

    from distllm.train.config import OptimConfig
    from tests.train._util import make_cfg

    out = str(tmp_path / "run")
    trainer.train(make_cfg(corpus, out, steps=4, save_final=True))
    cfg = make_cfg(corpus, out, steps=6, resume=True, save_final=True)
    trainer.train(cfg)
    assert cfg.optim.lr_decay_steps == 0
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    lrs = [json.loads(x)["lr"] for x in lines]
    end = OptimConfig().lr * OptimConfig().min_lr_ratio
    assert lrs[3:] == pytest.approx([end] * 3), lrs  # the 4-step schedule's end, held
    other = tmp_path / "other.txt"
    other.write_bytes(Path(corpus).read_bytes()[::-1])
    with pytest.raises(ValueError, match=f"trained on --data {corpus}, this command reads "
                                         f"--data {other} .*add --override-data"):
        trainer.train(make_cfg(str(other), out, steps=8, resume=True))
    with pytest.raises(ValueError, match="is at step 6, where --steps 6 ends: raise --steps"):
        trainer.train(make_cfg(corpus, out, steps=6, resume=True))
    # a fresh run into it (resume off) is refused as the command refuses it: it replaced
    # the run's checkpoints of its own steps, and a later resume mixed the two runs
    with pytest.raises(ValueError) as e:
        trainer.train(make_cfg(corpus, out, steps=3, save_final=True))
    assert str(e.value) == (f"--out {out} holds a previous run's checkpoints (step 6): pass "
                            f"--resume to continue it, or another --out")
    assert [d.name for d in checkpoint.complete(Path(out))] == ["step_00000004",
                                                                "step_00000006"]


def test_a_skipped_step_is_a_strict_json_line(corpus, tmp_path, monkeypatch):
    """A step whose gradient is NaN is skipped: its line of metrics.jsonl says so, with the
    norm as null (``json.dumps`` wrote ``NaN``, which is not JSON: jq and JSON.parse refuse
    the line), and so does the checkpoint's copy of the line in its meta.json."""
    import json

    from distllm.train.engine import Engine
    from tests.train._util import make_cfg

    real, calls = Engine.forward_backward, []

    def forward_backward(self, tok, tgt):
        calls.append(1)
        p = next(p for c in self.chunks for p in c.parameters())
        hook = p.register_hook(lambda g: g * float("nan")) if len(calls) == 2 else None
        try:
            return real(self, tok, tgt)
        finally:
            if hook is not None:
                hook.remove()

    monkeypatch.setattr(Engine, "forward_backward", forward_backward)
    out = tmp_path / "run"
    trainer.train(make_cfg(corpus, str(out), steps=3, save_every=2))

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}"))

    lines = [strict(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("skipped", False) for x in lines] == [False, True, False], lines
    assert lines[1]["grad_norm"] is None and lines[0]["grad_norm"] > 0, lines
    meta = next((out / "checkpoints").glob("step_00000002")) / "meta.json"
    assert strict(meta.read_text())["metrics"]["grad_norm"] is None


def test_a_resume_on_changed_data_is_refused_and_the_runs_own_folder_is_not_data(tmp_path):
    """A checkpoint records its data's fingerprint: a resume reading other contents at the
    same --data path is refused, naming --data and --override-data (it trained on, from the
    middle of an order drawn for other data); with --override-data it trains on from the
    data's start. --data naming a folder that holds --out (``--data . --out runs/train``)
    leaves the run's folder out: its checkpoints' meta.json files were read as text, so a
    resume trained on other data than the run began with."""
    from distllm.train.data import load_corpus
    from tests.train._util import make_cfg, write_corpus

    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data / "text.txt")
    out = data / "runs" / "train"
    trainer.train(make_cfg(str(data), str(out), steps=4, stop_after=2, save_final=True))
    assert list(out.glob("checkpoints/*/meta.json"))  # text, inside --data
    assert load_corpus(str(data), skip=str(out)).train.numel() == \
        load_corpus(str(data / "text.txt")).train.numel()
    trainer.train(make_cfg(str(data), str(out), steps=4, stop_after=3, resume=True,
                           save_final=True))  # the same data: the run's folder left out
    (data / "more.txt").write_text("other text\n" * 2000)
    with pytest.raises(ValueError) as e:
        trainer.train(make_cfg(str(data), str(out), steps=4, resume=True))
    assert str(e.value).startswith(f"--resume: --data {data} has changed since the checkpoint "
                                   f"in --out {out} trained on it ("), e.value
    assert str(e.value).endswith(" now): pass the data it trained on, or add "
                                 "--override-data to train on with this data, from its start")
    res = trainer.train(make_cfg(str(data), str(out), steps=4, resume=True,
                                 override_data=True))
    assert len(res.losses) == 1


def test_the_metrics_are_on_the_device_before_each_checkpoint(corpus, tmp_path, monkeypatch):
    """A checkpoint is synced to the device; the metrics lines before it were not (a power
    loss kept the checkpoint and lost its history, which a resume cannot write again)."""
    import os

    from tests.train._util import make_cfg

    real, synced = os.fsync, []

    def fsync(fd):
        try:
            synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # (not a file of this test's)
            synced.append("?")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    trainer.train(make_cfg(corpus, str(tmp_path / "run"), steps=4, save_every=2,
                           save_final=True))
    metas = [i for i, name in enumerate(synced) if name == "meta.json"]
    assert len(metas) == 2, synced  # steps 2 and 4
    for start, end in zip([0, *metas], metas, strict=False):  # before each checkpoint
        assert "metrics.jsonl" in synced[start:end], synced


def test_an_out_that_is_the_data_folder_resumes_on_the_same_data(tmp_path):
    """``--data F --out F``: the run's checkpoints land in the data folder, and their
    meta.json files (text) were read as data by the resume, which was then refused as
    "--data has changed" though the user changed nothing."""
    from tests.train._util import make_cfg, write_corpus

    data = tmp_path / "f"
    data.mkdir()
    write_corpus(data / "text.txt")
    trainer.train(make_cfg(str(data), str(data), steps=4, stop_after=2, save_final=True))
    assert list(data.glob("checkpoints/*/meta.json"))
    res = trainer.train(make_cfg(str(data), str(data), steps=4, resume=True))
    assert len(res.losses) == 2


def test_a_resume_does_not_draw_the_init_its_checkpoint_replaces(corpus, tmp_path, monkeypatch):
    """GPT-2's init draws every layer in float64 on every rank (minutes at 70B): a fresh run
    draws it, a resume (whose checkpoint replaces every weight) does not."""
    from distllm.models import sharding
    from tests.train._util import make_cfg

    drawn, real = [], sharding.init_canonical
    monkeypatch.setattr(sharding, "init_canonical",
                        lambda cfg, i, *a, **k: drawn.append(i) or real(cfg, i, *a, **k))
    out = str(tmp_path / "run")
    trainer.train(make_cfg(corpus, out, steps=2, save_final=True))
    assert drawn, "a fresh run did not draw its init"
    drawn.clear()
    trainer.train(make_cfg(corpus, out, steps=3, resume=True))
    assert drawn == []
