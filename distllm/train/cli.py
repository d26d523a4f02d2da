"""``distllm train``: train a GPT on TP x PP x DP x ZeRO.

The flags are generated from the config dataclasses of :mod:`distllm.train.config`: one flag
per field (``--<field-name>``, or the field's ``flag`` metadata), its type, default and
choices from the field, its help from the field's docstring; a boolean field that defaults to
True gets ``--no-<name>``. Only ``--nproc`` and ``--plan`` are not config fields.

Under ``torchrun`` (any number of nodes) every rank runs this command with the same options.
On one machine, ``--nproc N`` starts ``torchrun`` itself (``python -m torch.distributed.run
--standalone --nproc-per-node N -m distllm train ...``). With no GPU the ranks use gloo on the
CPU; with GPUs, NCCL. Bad input is checked here, before any rank starts, and reported as one
line with exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
import typing
from functools import cache
from typing import Any, NamedTuple

from distllm.cli import UsageError
from distllm.train.config import OptimConfig, ParallelConfig, TrainConfig, check_layout

__all__ = ["add_arguments", "run", "config_from_args", "config_to_argv", "apply_plan",
           "precheck", "field_docs"]

# (argument group, config class, attribute of TrainConfig holding it; None: TrainConfig itself)
SECTIONS = (("layout", ParallelConfig, "parallel"), ("run", TrainConfig, None),
            ("optimizer", OptimConfig, "optim"))


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass: the string literal under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


class Flag(NamedTuple):
    """One generated flag: the config field it sets and its ``add_argument`` arguments."""

    section: str | None
    field: str
    flag: str
    default: Any
    kwargs: dict[str, Any]


def _scalar_type(hint: Any) -> type:
    """``int``, ``float``, ``str`` or ``bool`` from a field's type (``str | None`` -> str)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


@cache
def flags(sections: tuple = SECTIONS) -> tuple[Flag, ...]:
    """The flags of every field of the ``sections``' config classes, in declaration order
    (nested configs skipped)."""
    out: list[Flag] = []
    for _, cls, section in sections:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            kind = _scalar_type(hints[f.name])
            if dataclasses.is_dataclass(kind):
                continue  # TrainConfig.parallel / .optim: their own section
            if f.name not in docs:
                raise TypeError(f"{cls.__name__}.{f.name} has no docstring: write one under it")
            help_ = docs[f.name].replace("``", "").replace("%", "%%")
            name = f.name.replace("_", "-")
            if kind is bool:
                flag = f.metadata.get("flag", f"--no-{name}" if f.default else f"--{name}")
                if f.default:
                    help_ += " On by default: this flag turns it off."
                kw = dict(action="store_false" if f.default else "store_true", help=help_)
            else:
                flag = f.metadata.get("flag", f"--{name}")
                kw = dict(type=kind, help=f"{help_} (default: %(default)s)")
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                else:
                    kw["metavar"] = flag.lstrip("-").upper().replace("-", "_")
            out.append(Flag(section, f.name, flag, f.default, kw))
    dests = [f.field for f in out] + ["nproc", "plan"]
    assert len(dests) == len(set(dests)), f"two config fields share a flag name: {dests}"
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    groups = {name: p.add_argument_group(name, cls.__doc__.splitlines()[0].replace("``", ""))
              for name, cls, _ in SECTIONS}
    g = groups["layout"]
    g.add_argument("--nproc", type=int, default=0,
                   help="start torchrun with N ranks on this machine (omit under torchrun)")
    g.add_argument("--plan", default="none", choices=("none", "auto"),
                   help="auto: take the planner's best layout for this world size (overrides "
                        "--tp --pp --dp --zero --schedule --micro-batches, the virtual stages, "
                        "sequence parallelism and activation checkpointing)")
    by_section = {section: name for name, _, section in SECTIONS}
    for f in flags():
        groups[by_section[f.section]].add_argument(f.flag, dest=f.field, default=f.default,
                                                   **f.kwargs)


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``distllm train`` arguments."""
    values: dict[str | None, dict[str, Any]] = {section: {} for _, _, section in SECTIONS}
    for f in flags():
        values[f.section][f.field] = getattr(a, f.field)
    return TrainConfig(parallel=ParallelConfig(**values["parallel"]),
                       optim=OptimConfig(**values["optim"]), **values[None])


def config_to_argv(cfg: TrainConfig) -> list[str]:
    """Command-line tokens that :func:`config_from_args` turns back into ``cfg`` (fields at
    their default are left out)."""
    out: list[str] = []
    for f in flags():
        value = getattr(cfg if f.section is None else getattr(cfg, f.section), f.field)
        if value == f.default:
            continue
        out += [f.flag] if isinstance(value, bool) else [f.flag, str(value)]
    return out


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def precheck(cfg: TrainConfig, world: int) -> None:
    """Every check that can run before a rank starts (raises ValueError / FileNotFoundError)."""
    from distllm.train import checkpoint

    mcfg = cfg.model_config()
    seq = cfg.seq_len or mcfg.max_seq_len
    if seq > mcfg.max_seq_len:
        raise ValueError(f"seq_len={seq} exceeds the {cfg.model} context {mcfg.max_seq_len}: "
                         f"lower --seq-len")
    check_layout(cfg, world, n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                 hidden=mcfg.hidden_size, seq_len=seq)
    if cfg.data is not None:
        from distllm.train.data import _files_of

        files = _files_of(cfg.data)
        if sum(f.stat().st_size for f in files) == 0:
            raise ValueError(f"--data {cfg.data}: the text is empty; pass a non-empty file")
    if cfg.resume:
        checkpoint.check_compatible(cfg.out, mcfg)


def _launch(nproc: int, argv: list[str]) -> int:
    """Start ``torchrun --standalone`` with ``nproc`` ranks running ``distllm train argv``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "distllm", "train", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // nproc)))
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"distllm train: error: a rank failed (exit code {proc.returncode}); see above",
              file=sys.stderr)
        return 2 if proc.returncode == 2 else 1
    return 0


def apply_plan(cfg: TrainConfig, world: int) -> tuple[TrainConfig, str]:
    """``cfg`` with the planner's best layout for ``world`` ranks, and why it was chosen."""
    import torch

    from distllm.plan import best_layout, detect_profile

    per_node = torch.cuda.device_count() or world
    layout, why = best_layout(cfg.model, world, min(per_node, world), detect_profile(),
                              global_batch=cfg.global_batch,
                              seq_len=cfg.seq_len or cfg.model_config().max_seq_len)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig.from_layout(layout, cfg.parallel),
                              activation_checkpointing=layout.checkpointing)
    return cfg, f"--plan auto chose {layout.name()} for {world} ranks:\n{why}"


def run(args: argparse.Namespace) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    cfg = config_from_args(args)
    if args.plan == "auto":
        cfg, why = apply_plan(cfg, args.nproc or int(os.environ.get("WORLD_SIZE", "1")))
        if int(os.environ.get("RANK", "0")) == 0:
            print(why, flush=True)
    if args.nproc:
        if under_torchrun:
            raise UsageError("--nproc starts torchrun itself: drop it under an external torchrun")
        if args.nproc < 1 or args.nproc > _cores() * 4:
            raise UsageError(f"--nproc {args.nproc}: this machine has {_cores()} cores; choose "
                             f"1..{_cores() * 4} ranks")
        precheck(cfg, args.nproc)
        return _launch(args.nproc, config_to_argv(cfg))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    precheck(cfg, world)
    from distllm.train.trainer import train

    train(cfg)
    return 0
