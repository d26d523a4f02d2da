"""``distllm train``: train a GPT on TP x PP x DP x ZeRO.

Under ``torchrun`` (any number of nodes) every rank runs this command with the same options.
On one machine, ``--nproc N`` starts ``torchrun`` itself (``python -m torch.distributed.run
--standalone --nproc-per-node N -m distllm train ...``). With no GPU the ranks use gloo on the
CPU; with GPUs, NCCL. Bad input is checked here, before any rank starts, and reported as one
line with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from distllm.cli import UsageError
from distllm.train.config import (
    ACTIVATION_CHECKPOINTING,
    DTYPES,
    SCHEDULES,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_layout,
)

__all__ = ["add_arguments", "run", "config_from_args"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=0,
                   help="start torchrun with N ranks on this machine (omit under torchrun)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--dp", type=int, default=-1, help="data-parallel size (-1: the rest)")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    g.add_argument("--micro-batches", type=int, default=0,
                   help="micro-batches per step and DP rank (0: pp, or 2*pp when interleaved)")
    g.add_argument("--virtual-stages", type=int, default=2,
                   help="model chunks per rank for interleaved-1f1b")
    g.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism")
    g.add_argument("--overlap", default="auto", choices=("auto", "chunked", "none"),
                   help="row-parallel GEMM/all-reduce overlap")
    g.add_argument("--plan", default="none", choices=("none", "auto"),
                   help="auto: take the planner's best layout for this world size (overrides "
                        "--tp --pp --dp --zero --schedule --micro-batches and checkpointing)")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DP gradient bucket MiB")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="collective timeout in seconds (a dead rank ends the job)")
    r = p.add_argument_group("run")
    r.add_argument("--model", default="tiny", help="GPT preset: tiny, gpt2-small, ...")
    r.add_argument("--global-batch", type=int, default=32, help="sequences per step")
    r.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: preset)")
    r.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--dtype", default="float32", choices=DTYPES)
    r.add_argument("--activation-checkpointing", default="none",
                   choices=ACTIVATION_CHECKPOINTING)
    r.add_argument("--data", default=None,
                   help="text file or folder (default: the Python standard library sources)")
    r.add_argument("--out", default="runs/train", help="folder for metrics and checkpoints")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --out")
    r.add_argument("--n-layers", type=int, default=0, help="override the preset's depth")
    r.add_argument("--stop-after", type=int, default=0,
                   help="stop (and save) after this step; the LR schedule still spans --steps")
    r.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    r.add_argument("--no-save", action="store_true", help="no checkpoint at the end")
    r.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--deterministic", action="store_true", help="deterministic kernels")
    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--warmup-steps", type=int, default=-1, help="-1: 5%% of the steps")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    par = ParallelConfig(
        tp=a.tp, pp=a.pp, dp=a.dp, zero=a.zero, schedule=a.schedule,
        micro_batches=a.micro_batches, virtual_stages=a.virtual_stages,
        sequence_parallel=a.sequence_parallel, overlap=a.overlap,
        bucket_cap_mb=a.bucket_cap_mb, timeout_s=a.timeout,
    )
    opt = OptimConfig(lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup_steps=a.warmup_steps,
                      weight_decay=a.weight_decay, grad_clip=a.grad_clip)
    return TrainConfig(
        model=a.model, parallel=par, optim=opt, global_batch=a.global_batch,
        seq_len=a.seq_len, steps=a.steps, seed=a.seed, dtype=a.dtype,
        activation_checkpointing=a.activation_checkpointing, data=a.data, out=a.out,
        resume=a.resume, n_layers=a.n_layers, stop_after=a.stop_after,
        save_every=a.save_every, save_final=not a.no_save,
        eval_batches=a.eval_batches, progress=not a.no_progress, deterministic=a.deterministic,
    )


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


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``torchrun --standalone`` with ``--nproc`` ranks running this same command."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "distllm", "train", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // args.nproc)))
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"distllm train: error: a rank failed (exit code {proc.returncode}); see above",
              file=sys.stderr)
        return 2 if proc.returncode == 2 else 1
    return 0


def _to_argv(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` as command-line tokens, without ``--nproc``."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out: list[str] = []
    for act in parser._actions:
        if not act.option_strings or act.dest in ("help", "nproc"):
            continue
        value = getattr(args, act.dest, act.default)
        if value == act.default:
            continue
        flag = act.option_strings[0]
        if isinstance(act, argparse._StoreTrueAction):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def apply_plan(args: argparse.Namespace, world: int) -> str:
    """Replace the layout options of ``args`` by the planner's best layout; return why."""
    import torch

    from distllm.models import GPTConfig
    from distllm.plan import best_layout, detect_profile

    mcfg = GPTConfig.preset(args.model)
    per_node = torch.cuda.device_count() or world
    layout, why = best_layout(args.model, world, min(per_node, world), detect_profile(),
                              global_batch=args.global_batch,
                              seq_len=args.seq_len or mcfg.max_seq_len)
    args.tp, args.pp, args.dp, args.zero = layout.tp, layout.pp, layout.dp, layout.zero
    args.micro_batches = layout.micro_batches
    args.schedule = layout.schedule if layout.pp > 1 else args.schedule
    args.virtual_stages = max(layout.virtual_stages, 1) if layout.pp > 1 else args.virtual_stages
    args.activation_checkpointing = layout.checkpointing
    args.sequence_parallel = layout.sequence_parallel
    args.plan = "none"
    return f"--plan auto chose {layout.name()} for {world} ranks:\n{why}"


def run(args: argparse.Namespace) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.plan == "auto":
        why = apply_plan(args, args.nproc or int(os.environ.get("WORLD_SIZE", "1")))
        if int(os.environ.get("RANK", "0")) == 0:
            print(why, flush=True)
    cfg = config_from_args(args)
    if args.nproc:
        if under_torchrun:
            raise UsageError("--nproc starts torchrun itself: drop it under an external torchrun")
        if args.nproc < 1 or args.nproc > _cores() * 4:
            raise UsageError(f"--nproc {args.nproc}: this machine has {_cores()} cores; choose "
                             f"1..{_cores() * 4} ranks")
        precheck(cfg, args.nproc)
        return _launch(args, _to_argv(args))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    precheck(cfg, world)
    from distllm.train.trainer import train

    train(cfg)
    return 0
