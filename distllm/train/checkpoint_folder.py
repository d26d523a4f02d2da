"""A run's checkpoint folders and their ``meta.json``: where they are (``OUT/checkpoints/
step_N``), which are complete, the newest, the metadata they hold and whether it fits a model,
the one-line error of a damaged one, and pruning the old ones. The tensors' save and load are
:mod:`distllm.train.checkpoint`'s."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["FORMAT", "complete", "latest", "step_of", "meta_of", "trained_positions_of",
           "record_of", "optim_settings", "check_compatible", "prune", "sync_dir"]

FORMAT = "distllm-gpt-ckpt-1"


def _ckpt_root(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoints"


_STEP_DIR = re.compile(r"step_(\d+)")


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints in ``root`` (folders ``step_N`` with their ``meta.json``: one
    moved aside as ``step_N.damaged`` is not one), oldest first."""
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name) and d.is_dir()
                   and (d / "meta.json").is_file()), key=step_of)


def step_of(path: Path) -> int:
    """The step of the checkpoint folder ``path`` (``step_00000042`` -> 42); ValueError
    naming a folder of another name."""
    m = _STEP_DIR.fullmatch(path.name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint's folder (step_N)")
    return int(m.group(1))


def complete(out: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``out`` (a run's --out), oldest first."""
    return _complete(_ckpt_root(out))


def latest(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``out`` (one with its ``meta.json``), or None."""
    done = complete(out)
    return done[-1] if done else None


def _model_key(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("name", None)
    d.pop("init_std", None)
    return d


def _damaged(path: Path, cause: str) -> ValueError:
    """The one-line error of a checkpoint that cannot be read, naming the previous complete
    one (which ``--resume``, ``export`` and ``sample`` take once this one is moved aside)."""
    m = _STEP_DIR.fullmatch(path.name)
    done = [d for d in _complete(path.parent) if m and step_of(d) < int(m.group(1))]
    then = (f"move it aside (e.g. rename it {path.name}.damaged) to go back to "
            f"{done[-1].name} (step {step_of(done[-1])})") if done else \
        ("no earlier checkpoint is complete: resume another --out, or export or sample "
         "another RUN")
    return ValueError(f"checkpoint {path} is damaged ({cause}): {then}")


def _cause(exc: BaseException) -> str:
    """The innermost message of ``exc`` on one line (DCP wraps each rank's error with its
    traceback: the first failed rank's error is named)."""
    prefix = ""
    while True:
        if isinstance(exc, CheckpointException) and exc.failures:
            rank, (exc, _) = min(exc.failures.items())
            prefix = f"rank {rank}: "
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    text = prefix + (" ".join(str(exc).split()) or type(exc).__name__)
    return text if len(text) <= 200 else text[:197] + "..."


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise _damaged(path, f"meta.json: {_cause(exc)}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "meta.json holds no object")
    if meta.get("format") == FORMAT and not isinstance(meta.get("model"), dict):
        raise _damaged(path, "meta.json: no model")
    return meta


def meta_of(path: Path) -> dict:
    """The meta.json of the checkpoint folder ``path`` (a one-line error if damaged)."""
    return _read_meta(path)


def trained_positions_of(path: Path, max_seq_len: int) -> int:
    """How many leading positions the run of the checkpoint folder ``path`` trained: its
    ``--seq-len`` (a resume keeps it), or every position of pretrained weights
    (``max_seq_len``, also for a checkpoint from before this was recorded)."""
    n = _read_meta(path).get("trained_positions", max_seq_len)
    return min(int(n), max_seq_len) if isinstance(n, int) and n > 0 else max_seq_len


def record_of(out: str | os.PathLike) -> dict | None:
    """The metrics line of the step of the newest checkpoint in ``out``, as saved with it
    (None when there is none, or it was saved without)."""
    path = latest(out)
    saved = None if path is None else _read_meta(path).get("metrics")
    return saved if isinstance(saved, dict) else None


def optim_settings(path: Path) -> dict | None:
    """The optimizer and learning-rate settings the checkpoint at ``path`` was trained with
    (:meth:`OptimConfig.schedule`), or None for a checkpoint saved before they were kept."""
    saved = _read_meta(path).get("optim")
    return saved if isinstance(saved, dict) else None


def check_compatible(out: str | os.PathLike, mcfg) -> Path:
    """Raise a one-line error when ``out`` has no complete checkpoint or one of another
    model; return the checkpoint's path otherwise."""
    path = latest(out)
    if path is None:
        metrics = Path(out) / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size > 0:  # a run that saved none
            raise FileNotFoundError(f"--resume: no complete checkpoint under "
                                    f"{_ckpt_root(out)}, only a previous run's metrics.jsonl: "
                                    f"pass another --out")
        raise FileNotFoundError(f"--resume: no complete checkpoint under {_ckpt_root(out)}; "
                                f"drop --resume to start afresh")
    meta = _read_meta(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a distllm GPT checkpoint (format "
                         f"{meta.get('format')!r}); pass another --out")
    theirs, ours = meta["model"], _model_key(mcfg)
    if theirs != ours:
        diff = {k: (theirs.get(k), ours.get(k)) for k in ours if theirs.get(k) != ours.get(k)}
        same_preset = meta.get("model_name") == mcfg.name
        fix = (f"pass --n-layers {diff['n_layers'][0]}" if same_preset and set(diff) ==
               {"n_layers"} else "pass the checkpoint's --model (and --n-layers)")
        raise ValueError(
            f"{path} holds a different model ({meta.get('model_name')!r}; differing "
            + ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items())
            + f"): {fix}, or another --out")
    return path


def sync_dir(path: Path) -> None:
    """Make the entries of the folder ``path`` durable (the files created or renamed in it):
    a file's own ``fsync`` does not cover its name in its folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(out: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints under ``out`` (``keep`` 0:
    none removed); returns the removed folders. Incomplete ones (no ``meta.json``) are left
    to the save that made them, and the newest complete one is always kept."""
    if keep <= 0:
        return []
    gone = _complete(_ckpt_root(out))[:-keep]
    for d in gone:
        # renamed first, so that a removal cut short never leaves a complete-looking folder
        aside = d.with_name(f".old-{d.name}")
        os.replace(d, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return gone
