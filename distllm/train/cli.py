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
import contextlib
import dataclasses
import inspect
import logging
import math
import os
import re
import signal
import sys
import tempfile
import textwrap
import typing
import uuid
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from distllm.cli import USAGE_ERRORS, UsageError
from distllm.train.config import (
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_init_from,
    check_layout,
)

__all__ = ["add_arguments", "run", "config_from_args", "config_to_argv", "apply_plan",
           "precheck", "check_out", "resume_optim", "field_docs"]

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
        if f.field in PLANNED:  # None: not given (the real default is filled in after)
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
        values[f.section][f.field] = f.default if value is None and f.field in PLANNED else value
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
    """Every check of the command that can run before a rank starts (raises ValueError /
    FileNotFoundError); the output folder's are :func:`check_out`'s."""
    mcfg = cfg.model_config()
    seq = cfg.seq_len or mcfg.max_seq_len
    if seq > mcfg.max_seq_len:
        raise ValueError(f"--seq-len {seq} exceeds the {cfg.model} context {mcfg.max_seq_len}: "
                         f"lower --seq-len")
    check_layout(cfg, world, n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                 hidden=mcfg.hidden_size, seq_len=seq)
    if cfg.data is not None:
        from distllm.train.data import _files_of, _token_files

        files = _token_files(cfg.data) or _files_of(cfg.data)
        if sum(f.stat().st_size for f in files if f is not None) == 0:
            raise ValueError(f"--data {cfg.data}: the data is empty; pass a non-empty file")
    check_init_from(cfg, mcfg)


def check_out(cfg: TrainConfig) -> None:
    """Checks of the output folder ``cfg.out``, which it creates: with ``--resume`` it holds
    a checkpoint of this model before ``--steps`` (and ``--stop-after``); without, no
    checkpoint (a later ``--resume`` would continue the other run) and no other run's
    metrics; a folder this process can write into."""
    from distllm.train import checkpoint

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {cfg.out}: it is a file, not a folder; pass another --out")
    if cfg.resume:
        path = checkpoint.check_compatible(out, cfg.model_config())
        step = checkpoint.step_of(path)
        if step >= cfg.steps:
            raise ValueError(f"--resume: the checkpoint in --out {cfg.out} is at step {step}, "
                             f"where --steps {cfg.steps} ends: raise --steps to train on")
        resume_optim(cfg, checkpoint.optim_settings(path))
        resume_data(cfg, checkpoint.meta_of(path))
        if cfg.stop_after and cfg.stop_after <= step:
            raise ValueError(f"--stop-after {cfg.stop_after}: the run resumes after step "
                             f"{step}; raise --stop-after, or drop it")
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


STOPPED_FILE = "stopped-by-signal.txt"
"""Written into :data:`USAGE_ERRORS_ENV`'s folder by a rank that stopped on a signal of
``--save-on-signal`` (after its checkpoint): the signal's name."""

LAUNCHER_PID_ENV = "DISTLLM_TRAIN_LAUNCHER_PID"
"""Set by ``--nproc``'s launcher for its ranks: its process id. A rank ends with it
(:func:`_end_with_launcher`), also when it is killed with SIGKILL, which it cannot pass on."""

TIMEOUT_PREFIX = "timeout-rank"
"""A rank whose collective timed out writes ``timeout-rank<R>.txt`` into
:data:`USAGE_ERRORS_ENV`'s folder: one line, which the launcher prints instead of its
traceback."""

USAGE_ERRORS_ENV = "DISTLLM_TRAIN_USAGE_ERRORS"
"""Set by ``--nproc``'s launcher for its ranks: a folder into which a rank writes its bad-input
message (``rank<R>.txt``) instead of printing it; the launcher prints each distinct one once.
Ranks of any other launcher print theirs."""


@contextlib.contextmanager
def _launcher_scope():
    """Restores what launching changes in this process: the environment, the signal handlers
    torch's elastic agent installs; and keeps its log records (of a failed rank, of the
    ranks it stops) off stderr unless ``LOGLEVEL`` (the agent's own knob) is set."""
    env = dict(os.environ)
    sigs = [s for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
            if hasattr(signal, s)]
    handlers = {s: signal.getsignal(getattr(signal, s)) for s in sigs}
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic",
                                              "torch.distributed.launcher")]
    quiet = logging.NullHandler()
    saved = [lg.propagate for lg in loggers]
    if "LOGLEVEL" not in os.environ:
        for lg in loggers:
            lg.addHandler(quiet)
            lg.propagate = False
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for s, h in handlers.items():
            signal.signal(getattr(signal, s), h)
        for lg, prop in zip(loggers, saved, strict=True):
            lg.removeHandler(quiet)
            lg.propagate = prop


def _launch(nproc: int, cfg: TrainConfig) -> int:
    """Run ``cfg`` on ``nproc`` ranks of this machine, as ``torchrun --standalone`` does
    (torch's elastic agent in this process, a c10d rendezvous on a free port, no restarts).
    Bad input a rank finds is printed once (exit code 2); another failure names the first
    failed rank (exit code 1). A signal stops the ranks: the agent passes it on (the signals
    of ``--save-on-signal`` too, which then save a checkpoint) and waits ``--timeout`` seconds
    for them (30 s on torch without ``shutdown_timeout``) before it kills them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from distllm.comm.compat import elastic_launch_config

    # the agent's own default, and the user signals (the ranks of --save-on-signal save on
    # them; without, their default action ends the ranks as it would have ended the
    # launcher, which must not die of them alone and leave the ranks training)
    passed_on = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    passed_on += [s for s in ("SIGUSR1", "SIGUSR2") if hasattr(signal, s)]

    with tempfile.TemporaryDirectory(prefix="distllm-train-") as tmp, _launcher_scope():
        errors = os.path.join(tmp, "usage-errors")
        os.mkdir(errors)
        os.environ[USAGE_ERRORS_ENV] = errors
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // nproc)))
        config = elastic_launch_config(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
            monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
            signals_to_handle=",".join(passed_on),
            shutdown_timeout=math.ceil(cfg.parallel.timeout_s))
        try:
            elastic_launch(config, sys.executable)("-m", "distllm", "train",
                                                   *config_to_argv(cfg))
        except ChildFailedError as exc:
            return _report_failure(exc, Path(errors), nproc)
        except SignalException as exc:
            print(f"distllm train: stopped by {exc.sigval.name}", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


def _report_failure(exc, errors: Path, nproc: int) -> int:
    """One line per distinct bad-input message the ranks left in ``errors`` (exit code 2);
    else, where ranks timed out in a collective, one line naming them and the ranks that
    did not answer; else one line naming the first failed rank of ``exc`` (a
    ``ChildFailedError``)."""
    if (stopped := errors / STOPPED_FILE).is_file():  # the ranks stopped on a signal, saved
        name = stopped.read_text().strip()
        print(f"distllm train: stopped by {name}", file=sys.stderr)
        return 128 + int(getattr(signal, name))
    messages: list[str] = []
    for f in sorted(errors.glob("rank*.txt"), key=lambda f: int(f.stem.removeprefix("rank"))):
        msg = f.read_text().strip()
        if msg and msg not in messages:
            messages.append(msg)
    for msg in messages:
        print(f"distllm train: error: {msg}", file=sys.stderr)
    if messages:
        return 2
    timed_out = sorted(int(f.stem.removeprefix(TIMEOUT_PREFIX))
                       for f in errors.glob(f"{TIMEOUT_PREFIX}*.txt"))
    crashed = [r for r, f in exc.failures.items() if r not in timed_out and f.exitcode > 0]
    if timed_out and not crashed:  # (a rank that failed on its own is the one to name)
        first = (errors / f"{TIMEOUT_PREFIX}{timed_out[0]}.txt").read_text().strip()
        silent = [r for r in range(nproc) if r not in timed_out]
        print(f"distllm train: error: rank {timed_out[0]} {first}"
              + (f"; ranks {silent} did not answer (stalled, or died)" if silent else ""),
              file=sys.stderr)
        return 1
    rank, failure = exc.get_first_failure()
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"failed (exit code {failure.exitcode}); its traceback is above"
    print(f"distllm train: error: rank {rank} {what}", file=sys.stderr)
    return 1


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


def _check_nproc(nproc: int) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise UsageError("--nproc starts torchrun itself: drop it under an external torchrun")
    if nproc < 1 or nproc > _cores() * 4:
        raise UsageError(f"--nproc {nproc}: this machine has {_cores()} cores; choose "
                         f"1..{_cores() * 4} ranks")


def _end_with_launcher() -> None:
    """Under ``--nproc``'s launcher (its pid in :data:`LAUNCHER_PID_ENV`): have Linux send this
    rank SIGTERM when the launcher dies (``prctl(PR_SET_PDEATHSIG)``), so that a launcher
    killed with SIGKILL (or by the OOM killer) does not leave its ranks training and writing
    into ``--out``; SIGTERM then stops them as a scheduler's would (with a checkpoint under
    ``--save-on-signal``). Elsewhere, or on another OS, nothing."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _rank(cfg: TrainConfig, world: int) -> int:
    """Train ``cfg`` as one rank of ``world`` (under a launcher, or alone). Under ``--nproc``'s
    launcher, bad input goes to the launcher's folder (:data:`USAGE_ERRORS_ENV`), exit code 2."""
    errors = os.environ.get(USAGE_ERRORS_ENV)
    _end_with_launcher()
    try:
        precheck(cfg, world)
        check_out(cfg)
        from distllm.train.trainer import train

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
        if errors is None or not _timed_out(exc):
            raise
        Path(errors, f"{TIMEOUT_PREFIX}{os.environ.get('RANK', '0')}.txt").write_text(
            f"waited longer than --timeout {cfg.parallel.timeout_s:g} s for a collective "
            f"({_first_line(exc)})")
        return 1
    return 0


def _summary(doc: str) -> str:
    """A config class's description for ``--help``: its docstring's first paragraph, joined
    into one line (a sentence wrapped over lines is not cut at the first)."""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")


def _first_line(exc: BaseException) -> str:
    """The error's first line without the C++ source location gloo prefixes (``[file:N]``)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line)[:160]


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's timeout (gloo's "Timed out waiting ... ms")."""
    return "timed out" in str(exc).lower()


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        _check_nproc(args.nproc)
    cfg = config_from_args(args)
    world = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    if args.plan == "auto":
        cfg, why = apply_plan(cfg, world, given_layout(args))
        if int(os.environ.get("RANK", "0")) == 0:
            print(why, flush=True)
    if args.nproc is None:
        return _rank(cfg, world)
    precheck(cfg, world)
    check_out(cfg)
    return _launch(args.nproc, cfg)
