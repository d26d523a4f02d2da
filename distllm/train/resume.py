"""What a ``--resume`` must agree on with the checkpoint it continues: the model, a step
before ``--steps`` (and ``--stop-after``), the optimizer and learning-rate settings (the
schedule's length taken from the checkpoint) and the data.

:func:`check_resume` runs wherever a run resumes: in :func:`distllm.train.trainer.train`
(the Python API, and each rank of ``distllm train``), and in ``distllm train --nproc``'s
launcher before its ranks start. A mismatch is one line naming the flag to change.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distllm.train.config import TrainConfig

__all__ = ["check_out", "check_resume", "resume_optim", "resume_data", "resolve_auto_resume",
           "out_lock"]

# set by ``distllm train --nproc``'s launcher, which holds the lock of this --out for its ranks
LOCK_HELD_ENV = "DISTLLM_OUT_LOCK_HELD"


@contextlib.contextmanager
def out_lock(out: str, rank: int = 0) -> Iterator[None]:
    """``out/.lock`` held (``flock``) by a run's rank 0 for as long as the run: a second run
    into the same ``--out`` while it runs is one ValueError. Two runs started together both
    passed :func:`check_out` (neither had saved yet), then each replaced the other's
    checkpoints and ``metrics.jsonl``. The other ranks, and the ranks of a launcher that
    holds it (:data:`LOCK_HELD_ENV`), do not lock; nor does a file system without locks. The
    lock ends with the process that holds it, so a restart after a crash takes it again."""
    if rank != 0 or os.environ.get(LOCK_HELD_ENV) == os.path.abspath(out):
        yield
        return
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        f = open(Path(out) / ".lock", "a+")  # noqa: SIM115 (held across the yield)
    except OSError:  # (check_out names what is wrong with --out)
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(f"--out {out} is in use by another run ({holder}): wait for it "
                             f"to end, or pass another --out") from None
        except OSError:  # no locks on this file system: unguarded, as before
            pass
        else:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        yield


def resolve_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--auto-resume`` decided: ``resume`` where ``out`` holds a complete
    checkpoint, a fresh run otherwise (``auto_resume`` then off, so that a launcher's ranks
    run what it decided)."""
    if not cfg.auto_resume:
        return cfg
    if cfg.resume:
        raise ValueError("--auto-resume with --resume: give one (--auto-resume resumes when "
                         "--out holds a checkpoint, and starts the run when it holds none)")
    from dataclasses import replace

    from distllm.train import checkpoint_folder as folder

    return replace(cfg, resume=folder.latest(cfg.out) is not None, auto_resume=False)


def check_out(cfg: TrainConfig) -> None:
    """Checks of the output folder ``cfg.out``, which it creates: with ``--resume`` it holds
    a checkpoint of this model (the rest of a resume's checks are :func:`check_resume`'s);
    without, no checkpoint (a later ``--resume`` would continue the other run, and this one
    would replace its checkpoints of the same steps) and no other run's metrics; a folder
    this process can write into. :func:`~distllm.train.trainer.train` runs it on every rank
    before the world starts, and ``distllm train --nproc``'s launcher before its ranks."""
    from distllm.train import checkpoint

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {cfg.out}: it is a file, not a folder; pass another --out")
    for name, kind in (("checkpoints", "a file"), ("metrics.jsonl", "a folder")):
        if (out / name).exists() and (out / name).is_dir() == (kind == "a folder"):
            raise ValueError(f"--out {cfg.out} holds {name} as {kind}, which the run writes "
                             f"as {'a folder' if kind == 'a file' else 'a file'}: remove it, "
                             f"or pass another --out")
    if cfg.resume:  # (what else it must agree on: check_resume's)
        checkpoint.check_compatible(out, cfg.model_config())
    elif (prev := checkpoint.latest(out)) is not None:
        raise ValueError(f"--out {cfg.out} holds a previous run's checkpoints (step "
                         f"{checkpoint.step_of(prev)}): pass --resume to continue "
                         f"it, or another --out")
    elif (metrics := out / "metrics.jsonl").is_file() and metrics.stat().st_size > 0:
        raise ValueError(f"--out {cfg.out} holds a previous run's metrics.jsonl (a run without "
                         f"checkpoints): pass another --out, or remove it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {cfg.out}: cannot create the folder ({exc.strerror}); pass "
                         f"another --out") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {cfg.out}: the folder is not writable; pass another --out")


def check_resume(cfg: TrainConfig) -> None:
    """Checks of ``cfg.out``'s newest checkpoint for a run with ``resume``: one of this
    model (:func:`~distllm.train.checkpoint_folder.check_compatible`) before ``--steps`` and
    ``--stop-after``, and :func:`resume_optim` (which sets ``cfg.optim.lr_decay_steps`` 0 to
    the checkpoint's schedule length) and :func:`resume_data`. Nothing for a fresh run."""
    if not cfg.resume:
        return
    from distllm.train import checkpoint_folder as folder

    path = folder.check_compatible(cfg.out, cfg.model_config())
    step = folder.step_of(path)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint in --out {cfg.out} is at step {step}, "
                         f"where --steps {cfg.steps} ends: raise --steps to train on")
    resume_optim(cfg, folder.optim_settings(path))
    resume_data(cfg, folder.meta_of(path))
    if cfg.stop_after and cfg.stop_after <= step:
        raise ValueError(f"--stop-after {cfg.stop_after}: the run resumes after step "
                         f"{step}; raise --stop-after, or drop it")


def resume_optim(cfg: TrainConfig, saved: dict | None) -> None:
    """On ``--resume``: the optimizer and learning-rate settings must be the checkpoint's
    ``saved`` ones (as :meth:`OptimConfig.schedule` resolves them), else a ValueError names
    each flag that differs, unless ``--override-optim``. The schedule keeps the checkpoint's
    length (``--lr-decay-steps`` 0 takes it), so that raising ``--steps`` trains on at the
    schedule's end instead of stretching it under the steps already run."""
    if saved is None or cfg.override_optim:
        return
    if cfg.optim.lr_decay_steps == 0 and "lr_decay_steps" in saved:
        cfg.optim.lr_decay_steps = int(saved["lr_decay_steps"])
    ours = cfg.optim.schedule(cfg.steps)
    differ = [f"--{k.replace('_', '-')} {ours[k]} (the checkpoint's: {saved[k]})"
              for k in ours if k in saved and ours[k] != saved[k]]
    if differ:
        raise ValueError(
            f"--resume: this command's optimizer settings differ from those the checkpoint in "
            f"--out {cfg.out} was trained with: {', '.join(differ)}; pass the checkpoint's, or "
            f"add --override-optim to train on with this command's")


def resume_data(cfg: TrainConfig, meta: dict) -> None:
    """On ``--resume``: the data must be what the checkpoint trained on (its ``--data``, and
    the kind of tokens: a tokenizer's ids or text's bytes), else a ValueError names
    ``--data``, unless ``--override-data``. A checkpoint saved before the data was recorded
    is checked on its kind of tokens alone."""
    from distllm.train.data import data_source, tokens_of

    if cfg.override_data:
        return
    kinds = {"ids": "a tokenizer's ids", "bytes": "text, as bytes"}
    theirs, their_kind = meta.get("data_source"), meta.get("tokens")
    ours, kind = data_source(cfg.data), tokens_of(cfg.data)
    if theirs in (None, ours) and their_kind in (None, kind):
        return
    if theirs is None:
        was, fix = kinds.get(their_kind, their_kind), "pass the --data it trained on"
    elif theirs == "python-stdlib":
        was, fix = "the default corpus", "drop --data"
    else:
        was, fix = f"--data {theirs}", f"pass --data {theirs}"
    now = "the default corpus" if cfg.data is None else f"--data {cfg.data}"
    raise ValueError(
        f"--resume: the checkpoint in --out {cfg.out} trained on {was}, this command reads "
        f"{now} ({kinds[kind]}): {fix}, or add --override-data to train on with this "
        f"command's data, from its start")
