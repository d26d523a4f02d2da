"""Shared pieces of the training tests: a small corpus, configs, and rank functions."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from distllm.train.config import OptimConfig, ParallelConfig, TrainConfig


def write_corpus(path: Path, n_bytes: int = 200_000) -> str:
    """A deterministic text file: the first ``n_bytes`` of sorted standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(root.glob("*.py")):
        b = f.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= n_bytes:
            break
    path.write_bytes(b"\n\n".join(chunks)[:n_bytes])
    return str(path)


SEED = 7  # every test run's (the initial weights: distllm.models.sharding.init_canonical)


def make_cfg(data: str, out: str, *, tp=1, pp=1, dp=-1, zero=0, schedule="1f1b", m=0, v=2,
             sp=False, overlap="none", vp="auto", bs=0, steps=3, dtype="float64",
             ogr="auto", **kw) -> TrainConfig:
    """A run of the ``tiny`` GPT with the trainer's default optimizer settings (``OptimConfig()``:
    weight decay, clipping and warm-up all on), so that parity runs exercise them. ``vp``:
    ``vocab_parallel`` (the ``tiny`` vocabulary is small: "auto" holds it whole under TP);
    ``bs``: ``batch_split`` (0: auto); ``ogr``: ``overlap_grad_reduce``."""
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, schedule=schedule, micro_batches=m,
                         virtual_stages=v, sequence_parallel=sp, overlap=overlap,
                         vocab_parallel=vp, batch_split=bs, overlap_grad_reduce=ogr,
                         timeout_s=120)
    kw.setdefault("global_batch", 8)
    kw.setdefault("seq_len", 32)
    kw.setdefault("eval_batches", 0)
    kw.setdefault("save_final", False)
    return TrainConfig(model="tiny", parallel=par, optim=OptimConfig(),
                       steps=steps, seed=SEED, dtype=dtype, data=data, out=out, progress=False,
                       **kw)


def train_many(runs: list[dict], data: str, out: str) -> list[list[float]]:
    """Rank function: train each layout of ``runs`` in turn on this world; per-step losses."""
    from distllm.train.trainer import train

    results = []
    for i, kw in enumerate(runs):
        kw = dict(kw)
        res = train(make_cfg(data, kw.pop("out", f"{out}/run{i}"), **kw))
        results.append(res.losses)
    return results


def save_tiny_gpt2(path, seed: int = 3, **config) -> None:
    """A random Hugging Face GPT-2 of the ``tiny`` preset's shape (non-trivial norms and
    biases), saved as ``save_pretrained`` writes it; ``config``: GPT2Config fields to change
    (e.g. ``tie_word_embeddings=False``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                     n_inner=512, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     bos_token_id=0, eos_token_id=0, **config)
    hf = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)


def record_syncs(monkeypatch) -> list[tuple[str, ...]]:
    """The ``os.fsync`` (``("fsync", path)``) and ``os.replace`` (``("replace", src, dst)``)
    calls from now on, in order, into the list returned; both still run."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events
