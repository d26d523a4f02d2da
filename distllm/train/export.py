"""``distllm export``: a training checkpoint as a Hugging Face GPT-2 folder.

A checkpoint holds each layer's full canonical tensors (:mod:`distllm.train.checkpoint`: the
fp32 masters under mixed precision), so one process reads them, without a process group or
the layout the run trained at, and writes what ``GPT2LMHeadModel.save_pretrained`` writes
(``config.json`` and ``model.safetensors``), in the checkpoint's dtype. The folder loads with
``GPT2LMHeadModel.from_pretrained`` and starts another run with ``distllm train
--init-from``. It is written beside the destination and renamed into place once complete,
so a failed export leaves nothing behind; an existing destination is refused.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

__all__ = ["add_arguments", "run", "export_hf", "checkpoint_of", "needs_transformers"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN",
                   help="a training run's --out folder (its newest complete checkpoint), or "
                        "one checkpoint folder (RUN/checkpoints/step_00000300 for step 300)")
    p.add_argument("dest", metavar="DEST",
                   help="a new folder for the Hugging Face GPT-2 model")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint of this step of RUN (default: the newest)")


def checkpoint_of(run: str, step: int | None) -> Path:
    """The checkpoint folder RUN names (a run's --out: its newest complete checkpoint, or
    that of ``step``; or a checkpoint folder itself), for ``export`` and ``sample``;
    ValueError / FileNotFoundError naming RUN or ``--step``."""
    from distllm.train import checkpoint

    p = Path(run)
    if not p.is_dir():
        raise FileNotFoundError(f"RUN {run}: no such folder")
    if (p / "meta.json").is_file():  # a checkpoint folder itself
        if step is not None and checkpoint.step_of(p) != step:
            raise ValueError(f"--step {step}: RUN {run} is the checkpoint of step "
                             f"{checkpoint.step_of(p)}; drop --step, or pass the run's folder")
        return p
    done = checkpoint.complete(p)
    if not done:
        raise FileNotFoundError(f"RUN {run}: no complete checkpoint under {p / 'checkpoints'}; "
                                f"pass a training run's --out folder")
    if step is None:
        return done[-1]
    have = {checkpoint.step_of(d): d for d in done}
    if step not in have:
        raise ValueError(f"--step {step}: RUN {run} has checkpoints of steps "
                         f"{', '.join(map(str, sorted(have)))}")
    return have[step]


def export_hf(ckpt: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Write the checkpoint folder ``ckpt`` as a Hugging Face GPT-2 folder ``dest`` (which
    must not exist); returns ``dest``."""
    from distllm.models.hf import hf_from_layers, quiet_transformers
    from distllm.train.checkpoint import read_layers
    from distllm.train.new_folder import new_folder, write_failed

    with new_folder(dest) as tmp:
        cfg, layers, tokens = read_layers(Path(ckpt))
        hf = hf_from_layers(cfg, layers)
        if tokens is not None:  # --init-from reads it: text trains a model of bytes only
            hf.config.distllm_tokens = tokens
        from safetensors import SafetensorError  # (transformers' writer of the weights)

        with quiet_transformers():
            try:
                hf.save_pretrained(tmp)
            except (OSError, SafetensorError) as exc:  # a full disk, a failing device: the
                raise write_failed(dest, exc) from None  # new folder goes
    return Path(dest)


def needs_transformers(command: str) -> None:
    """ValueError (one line) where the transformers package, which ``command`` needs, is not
    installed."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"distllm {command} needs the transformers package (pip install "
                         f"transformers)")


def run(args: argparse.Namespace) -> int:
    needs_transformers("export")
    ckpt = checkpoint_of(args.run, args.step)
    dest = export_hf(ckpt, args.dest)
    print(f"distllm export: {ckpt} -> {dest} (Hugging Face GPT-2; load it with "
          f"GPT2LMHeadModel.from_pretrained, or train from it with --init-from)")
    return 0
