"""``distllm train``: train a GPT on TP x PP x DP x ZeRO.

The flags are generated from the config dataclasses of :mod:`distllm.train.config`: one flag
per field (``--<field-name>``, or the field's ``flag`` metadata), its type, default and
choices from the field, its help from the field's docstring; a boolean field that defaults to
True gets ``--no-<name>``. Only ``--nproc`` and ``--plan`` are not config fields.

Under ``torchrun`` (any number of nodes) every rank runs this command with the same options.
On one machine, ``--nproc N`` launches the ranks itself as ``torchrun --standalone
--nproc-per-node N -m distllm train ...`` would (torch's elastic agent, in this process). With
no GPU the ranks use gloo on the CPU; with GPUs, NCCL. Bad input is checked here, before any
rank starts, and reported as one line with exit code 2; what only a rank can find (the data
too short for a batch, a checkpoint of another batch size) is reported once the same way, and
any other failure of a rank ends the job with one line naming it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import signal
import textwrap
import typing
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from distllm.cli import USAGE_ERRORS, UsageError
from distllm.parallel.mesh import env_world_size
from distllm.train.config import (
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_init_from,
    check_layout,
)
from distllm.train.footprint import check_fits, ranks_on_this_machine
from distllm.train.launch import (
    LOST_PREFIX,
    STOPPED_FILE,
    TIMEOUT_PREFIX,
    USAGE_ERRORS_ENV,
    check_nproc,
    end_with_launcher,
    first_line,
    launch,
    lost_peer,
    timed_out,
)
from distllm.train.resume import (
    LOCK_HELD_ENV,
    check_out,
    check_resume,
    out_lock,
    resolve_auto_resume,
    resume_data,
    resume_optim,
)

__all__ = ["add_arguments", "run", "config_from_args", "config_to_argv", "apply_plan",
           "precheck", "check_out", "check_unused", "check_resume", "resume_optim",
           "resume_data", "field_docs"]

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


PLANNED = ("tp", "pp", "dp", "zero", "schedule", "micro_batches", "virtual_stages",
           "sequence_parallel", "activation_checkpointing")
"""The fields ``--plan auto`` decides; parsed with a default of None, so that the ones given
on the command line are known (and pinned for the planner)."""
_PIN_NAMES = {"activation_checkpointing": "checkpointing"}  # the planner's name for a field

UNSET = (*PLANNED, "seed")
"""The fields parsed with a default of None, so that the ones given on the command line are
known: :data:`PLANNED`'s, and ``seed`` (a resume refuses another than its checkpoint's)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    groups = {name: p.add_argument_group(name, _summary(cls.__doc__))
              for name, cls, _ in SECTIONS}
    g = groups["layout"]
    g.add_argument("--nproc", type=int, default=None,
                   help="start torchrun with N ranks on this machine (omit under torchrun)")
    g.add_argument("--plan", default="none", choices=("none", "auto"),
                   help="auto: take the planner's best layout for this world size (its --tp "
                        "--pp --dp --zero --schedule --micro-batches, sequence parallelism and "
                        "activation checkpointing; those given with it are pinned, as in "
                        "distllm plan)")
    by_section = {section: name for name, _, section in SECTIONS}
    for f in flags():
        kw, default = dict(f.kwargs), f.default
        if f.field in UNSET:  # None: not given (the real default is filled in after)
            kw["help"] = kw["help"].replace("%(default)s", str(f.default))
            default = None
        groups[by_section[f.section]].add_argument(f.flag, dest=f.field, default=default, **kw)


def given_layout(a: argparse.Namespace) -> dict[str, Any]:
    """The layout fields given on the command line (of :data:`PLANNED`), with their values."""
    return {f: getattr(a, f) for f in PLANNED if getattr(a, f, None) is not None}


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``distllm train`` arguments."""
    values: dict[str | None, dict[str, Any]] = {section: {} for _, _, section in SECTIONS}
    for f in flags():
        value = getattr(a, f.field)
        values[f.section][f.field] = f.default if value is None and f.field in UNSET else value
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
        # one token per value: a value that starts with "-" (--out=-x) stays a value
        out += [f.flag] if isinstance(value, bool) else [f"{f.flag}={value}"]
    return out


def precheck(cfg: TrainConfig, world: int, ranks_here: int | None = None) -> None:
    """Every check of the command that can run before a rank starts (raises ValueError /
    FileNotFoundError); the output folder's are :func:`check_out`'s. ``ranks_here``: the
    ranks this machine runs (None: as its launcher says, see
    :func:`~distllm.train.footprint.ranks_on_this_machine`)."""
    mcfg = cfg.model_config()
    seq = cfg.seq_len or mcfg.max_seq_len
    if seq > mcfg.max_seq_len:
        raise ValueError(f"--seq-len {seq} exceeds the {cfg.model} context {mcfg.max_seq_len}: "
                         f"lower --seq-len")
    dp = check_layout(cfg, world, n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                      hidden=mcfg.hidden_size, seq_len=seq)
    p = cfg.parallel
    check_fits(mcfg, cfg.dtype, model=cfg.model, tp=p.tp, pp=p.pp, dp=dp, zero=p.zero,
               ranks_here=ranks_here or ranks_on_this_machine())
    if cfg.data is not None:
        from distllm.train.data import _files_of, _token_files

        files = _token_files(cfg.data) or _files_of(cfg.data, skip=cfg.out)
        if sum(f.stat().st_size for f in files if f is not None) == 0:
            raise ValueError(f"--data {cfg.data}: the data is empty; pass a non-empty file")
    check_init_from(cfg, mcfg)


def apply_plan(cfg: TrainConfig, world: int,
               given: dict[str, Any] | None = None) -> tuple[TrainConfig, str]:
    """``cfg`` with the planner's best layout for ``world`` ranks, and why it was chosen: the
    layout of the model this run trains (``--n-layers`` included) in its ``--dtype``, with the
    layout fields ``given`` on the command line pinned."""
    given = dict(given or {})
    if "virtual_stages" in given:
        raise UsageError("--plan auto chooses the virtual stages with the schedule: drop "
                         "--virtual-stages (or --plan auto)")
    if given.get("dp") == -1:
        given.pop("dp")  # -1: "the rest of the world", which the planner decides anyway
    pins = {_PIN_NAMES.get(k, k): v for k, v in given.items()}
    p = cfg.parallel
    if "sequence_parallel" not in pins and (p.vocab_parallel == "off"
                                            or p.batch_split not in (0, 1)):
        # flags a sequence-parallel run refuses (distllm train has no flag to switch it off):
        # the vocabulary held whole, or TP's all-reduces split by batch
        pins["sequence_parallel"] = False
    import torch

    from distllm.plan import best_layout, detect_profile, preset

    mcfg = cfg.model_config()
    shape = preset(cfg.model).with_(layers=mcfg.n_layers)
    per_node = torch.cuda.device_count() or world
    layout, why = best_layout(shape, world, min(per_node, world), detect_profile(),
                              dtype=cfg.dtype, global_batch=cfg.global_batch,
                              seq_len=cfg.seq_len or mcfg.max_seq_len, pins=pins,
                              world_flag="--nproc")  # the planner's --gpus is this run's
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig.from_layout(layout, cfg.parallel),
                              activation_checkpointing=layout.checkpointing)
    return cfg, f"--plan auto chose {layout.name()} for {world} ranks:\n{why}"


def _rank(cfg: TrainConfig, world: int) -> int:
    """Train ``cfg`` as one rank of ``world`` (under a launcher, or alone). Under ``--nproc``'s
    launcher, bad input goes to the launcher's folder (:data:`USAGE_ERRORS_ENV`), exit code 2."""
    errors = os.environ.get(USAGE_ERRORS_ENV)
    end_with_launcher()
    try:
        precheck(cfg, world)
        from distllm.train.trainer import train  # (which checks --out: check_out)

        result = train(cfg)
        if result.stopped_by is not None and result.steps_done < cfg.steps:
            # stopped by a signal, saved: not a finished run (a scheduler or a script reads
            # the exit code); under --nproc the launcher says so once
            if errors is not None:
                Path(errors, STOPPED_FILE).write_text(result.stopped_by)
            return 128 + int(getattr(signal, result.stopped_by))
    except KeyboardInterrupt:  # Ctrl-C, or the launcher passing it on: it says so once
        return 128 + signal.SIGINT
    except USAGE_ERRORS as exc:
        if errors is None:
            raise
        Path(errors, f"rank{os.environ.get('RANK', '0')}.txt").write_text(str(exc))
        return 2
    except RuntimeError as exc:  # (torch.distributed's errors are RuntimeErrors)
        if errors is not None and lost_peer(exc):  # a rank died: its exit is the news
            Path(errors, f"{LOST_PREFIX}{os.environ.get('RANK', '0')}.txt").write_text(
                first_line(exc))
            return 1
        if errors is None or not timed_out(exc):
            raise
        Path(errors, f"{TIMEOUT_PREFIX}{os.environ.get('RANK', '0')}.txt").write_text(
            f"waited longer than --timeout {cfg.parallel.timeout_s:g} s for a collective "
            f"({first_line(exc)})")
        return 1
    return 0


def _summary(doc: str) -> str:
    """A config class's description for ``--help``: its docstring's first paragraph, joined
    into one line (a sentence wrapped over lines is not cut at the first)."""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")


def check_unused(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """A UsageError naming a flag given on the command line, at another value than its
    default, that this run would not use (a feature of a parallel dimension the layout does
    not have, a resume-only flag on a fresh run, a token-file dtype for text, a ``--seed``
    other than the seed of the checkpoint a resume continues), instead of training without
    it. Under ``--plan auto`` ``cfg`` holds the planned layout, and the flags of a
    parallel dimension it does not have are refused but for ``--schedule`` and
    ``--virtual-stages`` (the planner chooses the schedule)."""
    unused = _unused_layout(args, cfg.parallel)
    if args.plan == "auto":
        unused = [u for u in unused if not u.startswith(("--schedule", "--virtual-stages"))]
    if cfg.resume and args.seed is not None:
        unused += _resumed_seed(args.seed, cfg.out)
    for flag, on in (("--override-optim", cfg.override_optim),
                     ("--override-data", cfg.override_data)):
        # (with --auto-resume, a first attempt starts fresh and its restarts resume)
        if on and not cfg.resume and not getattr(args, "auto_resume", False):
            unused.append(f"{flag} applies to a --resume only: add --resume, or drop it")
    default_dtype = next(f.default for f in flags() if f.field == "data_dtype")
    if cfg.data_dtype != default_dtype and (cfg.data is None or Path(cfg.data).exists()):
        from distllm.train.data import tokens_of

        if tokens_of(cfg.data) == "bytes":
            data = "the default corpus" if cfg.data is None else f"--data {cfg.data}"
            unused.append(f"--data-dtype {cfg.data_dtype} reads .bin token files, and {data} "
                          f"is text (read as bytes): pass a .bin --data, or drop it")
    if unused:
        raise UsageError(f"{unused[0]} (this run would not use it)")


def _resumed_seed(seed: int, out: str) -> list[str]:
    """:func:`check_unused`'s finding on a ``--seed`` given with ``--resume``: a resume
    keeps its checkpoint's seed (the data order), so another one is not used."""
    from distllm.train import checkpoint_folder as folder

    path = folder.latest(out)
    theirs = None if path is None else folder.meta_of(path).get("data", {}).get("seed")
    if theirs is None or int(theirs) == seed:
        return []
    return [f"--seed {seed}: a --resume keeps the data order of its checkpoint in --out "
            f"{out}, shuffled with --seed {theirs}: pass --seed {theirs}, or drop it"]


def _unused_layout(args: argparse.Namespace, p: ParallelConfig) -> list[str]:
    """:func:`check_unused`'s findings among the layout's flags."""
    defaults = {f.field: f.default for f in flags()}  # (a sweep may write every flag)
    given = {k: v for k, v in given_layout(args).items() if v != defaults[k]}
    unused = []
    if given.get("sequence_parallel") and p.tp == 1:
        unused.append("--sequence-parallel shards activations inside a TP group: raise --tp, "
                      "or drop it")
    if args.vocab_parallel == "on" and p.tp == 1:
        unused.append("--vocab-parallel on splits the vocabulary over TP: raise --tp, or drop "
                      "it")
    if args.overlap != defaults["overlap"] and p.tp == 1:
        unused.append(f"--overlap {p.overlap} sets how TP's row-parallel GEMMs overlap their "
                      f"all-reduce: raise --tp, or drop it")
    if args.batch_split != defaults["batch_split"] and (p.tp == 1 or p.sequence_parallel):
        where = (": raise --tp, or drop it" if p.tp == 1 else ", which --sequence-parallel "
                 "replaces with reduce-scatters: drop one of them")
        unused.append(f"--batch-split {p.batch_split} splits micro-batches to overlap TP's "
                      f"all-reduces{where}")
    if "schedule" in given and p.pp == 1:
        unused.append(f"--schedule {p.schedule} orders a pipeline's micro-batches: raise --pp, "
                      f"or drop it")
    if "virtual_stages" in given and p.chunks_per_rank == 1:
        unused.append(f"--virtual-stages {p.virtual_stages} is read by --schedule "
                      f"interleaved-1f1b at --pp > 1 only: use that schedule, or drop it")
    return unused


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        check_nproc(args.nproc)
    # --auto-resume decided first, as --resume would be given (a rank under the launcher
    # gets the launcher's decision)
    cfg = resolve_auto_resume(config_from_args(args))
    world = args.nproc or env_world_size()
    if args.plan == "auto":
        cfg, why = apply_plan(cfg, world, given_layout(args))
        if int(os.environ.get("RANK", "0")) == 0:
            print(why, flush=True)
    if USAGE_ERRORS_ENV not in os.environ:
        # (a rank of --nproc's launcher reads the launcher's checked config, its --plan auto
        # choice included, which keeps a --schedule given with it when the plan has no
        # pipeline)
        check_unused(args, cfg)
    if args.nproc is None:
        return _rank(cfg, world)
    precheck(cfg, world, ranks_here=args.nproc)
    with out_lock(cfg.out):  # held here for the ranks (no other run into this --out)
        check_out(cfg)
        # before the ranks start (each checks again in train); the schedule's length it
        # takes from the checkpoint goes to them as --lr-decay-steps
        check_resume(cfg)
        os.environ[LOCK_HELD_ENV] = os.path.abspath(cfg.out)
        try:
            return launch(args.nproc, config_to_argv(cfg), cfg.parallel.timeout_s)
        finally:
            os.environ.pop(LOCK_HELD_ENV, None)
