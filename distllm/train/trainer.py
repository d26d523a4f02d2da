"""The training loop: data, the assembled engine, the learning-rate schedule, metrics,
progress, checkpoints and the validation loss.

Every rank runs :func:`train`; rank 0 shows the progress bar and writes
``out/metrics.jsonl`` (one JSON object per step: ``step``, ``loss``, ``tokens_per_s``, ``lr``,
``grad_norm``, ``step_time_s``, ``mfu``, ``tokens``, and ``overlap_tuning``: whether a
tensor-parallel layer of rank 0 was in ``overlap="auto"``'s trial in the step, whose calls
alternate between schedules, or its data-parallel gradient reduction in
``--overlap-grad-reduce auto``'s, before or after this step; ``skipped``: true for a step
whose gradient was inf/NaN; ``val_loss`` at a step that validated: every ``--eval-every``
steps, and the last of ``--steps``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from distllm.comm.compat import tf32_matmul_allowed
from distllm.dtypes import dtype_name
from distllm.parallel.mesh import ParallelDims
from distllm.train.config import TrainConfig, check_init_from, check_layout
from distllm.train.data import (
    BatchLoader,
    check_same_data,
    check_vocab,
    fingerprint,
    load_corpus,
)
from distllm.train.host_memory import keep_freed_memory
from distllm.train.resume import check_out, check_resume, out_lock, resolve_auto_resume

__all__ = ["train", "lr_at", "TrainResult", "peak_flops"]


def _decayed(step: int, start: int, steps: int) -> float:
    """How far ``step`` is into a decay from ``start`` that ends at step ``steps - 1``: 0 at
    ``start``, 1 from the last step on (a decay of one step is its last: 1)."""
    span = steps - 1 - start
    return 1.0 if span <= 0 else min(1.0, (step - start) / span)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of ``step`` (0-based): linear warm-up to ``lr``, then the
    ``lr_schedule`` (:data:`~distllm.train.config.LR_SCHEDULES`) down to ``lr *
    min_lr_ratio`` at the schedule's last step (``--lr-decay-steps``, else ``--steps``), and
    that value after it."""
    o, sch = cfg.optim, cfg.optim.schedule(cfg.steps)
    warm, steps = sch["warmup_steps"], sch["lr_decay_steps"]
    if step < warm:
        return o.lr * (step + 1) / warm
    lo = o.lr * o.min_lr_ratio
    if o.lr_schedule == "constant":
        return o.lr
    if o.lr_schedule == "wsd":  # stable to the decay's start, then linear
        start = max(warm, steps - max(1, round(o.decay_fraction * steps)))
        if step < start:
            return o.lr
        return o.lr - (o.lr - lo) * _decayed(step, start, steps)  # as linear's, from start
    frac = _decayed(step, warm, steps)
    if o.lr_schedule == "linear":
        return o.lr - (o.lr - lo) * frac
    return lo + 0.5 * (o.lr - lo) * (1 + math.cos(math.pi * frac))


def peak_flops(dtype: torch.dtype, device: torch.device) -> tuple[float, str]:
    """Peak FLOP/s of one rank's device for MFU: on a GPU with a hardware profile
    (:mod:`distllm.plan.hardware`), the profile's dense figure for ``dtype`` (TF32's for
    float32 when TF32 matmuls are allowed); else a GEMM rate measured on ``device`` (a
    practical peak). Returns ``(flops, how)``."""
    if device.type == "cuda":
        from distllm.plan.hardware import detect_profile, load_profile

        name = dtype_name(dtype)
        if dtype == torch.float32 and tf32_matmul_allowed():
            name = "tf32"
        try:
            prof = load_profile(detect_profile())
            return prof.flops(name), f"profile {prof.name} ({name})"
        except ValueError:  # a GPU without a profile, or a profile without this dtype
            pass
    return _measured_flops(dtype, device)


def _measured_flops(dtype: torch.dtype, device: torch.device) -> tuple[float, str]:
    """The best of 5 timed square GEMMs on ``device`` (drawn from a generator of its own:
    the caller's random state, saved in checkpoints, is left as it was)."""
    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    a = torch.randn(n, n, device=device, generator=torch.Generator(device).manual_seed(0),
                    dtype=dtype if cuda or dtype != torch.bfloat16 else torch.float32)
    a @ a
    dt = float("inf")
    for _ in range(5):  # the best of 5: a loaded machine only slows some of them
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ a
        if cuda:
            torch.cuda.synchronize(device)
        dt = min(dt, time.perf_counter() - t0)
    return 2 * n**3 / max(dt, 1e-9), f"best of 5 measured {n}^3 GEMMs on {device}"


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    """The validation loss after the last step (``--steps``), or None."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Every validation loss of this run, by step (``--eval-every``, and the last step)."""
    baseline: float = 0.0
    steps_done: int = 0
    stopped_by: str | None = None
    """The signal that stopped the run (``--save-on-signal``), or None."""


class _Progress:
    """Rank 0's progress bar (rich): step, loss, tokens/s, MFU and ETA."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                            transient=False, refresh_per_second=4)
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def update(self, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)

    def write(self, msg: str, dims: ParallelDims) -> None:
        """A line from rank 0, above the bar while it runs."""
        if self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False)
        else:
            _log(msg, dims)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _log(msg: str, dims: ParallelDims) -> None:
    if dims.rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _validate(engine, corpus, cfg: TrainConfig, seq: int, dims: ParallelDims,
              say: bool = True) -> float | None:
    """The mean loss of ``--eval-batches`` global batches of the held-out data (the same
    batches at every call), or None where there are none (said on rank 0 when ``say``)."""
    if cfg.eval_batches == 0:
        return None
    n_windows = max(0, len(corpus.val) - 1) // seq
    # one global batch, or where the held-out data holds less, the most whole sequences that
    # split evenly over the DP ranks and each pipeline's micro-batches (the forward-only
    # schedule takes any batch shape)
    m = engine.pipeline.micro_batches if engine.pipeline is not None else 1
    unit = dims.dp * m
    batch = min(cfg.global_batch, n_windows // unit * unit)
    if batch == 0:
        if say:
            _log(f"validation skipped: the held-out data holds {n_windows} sequences of {seq} "
                 f"tokens, fewer than one per data-parallel rank and micro-batch ({unit})",
                 dims)
        return None
    loader = BatchLoader(corpus.val, seq_len=seq, global_batch=batch, dp=dims.dp,
                         dp_rank=dims.dp_rank, seed=cfg.seed, shuffle=False,
                         vocab_size=engine.mcfg.vocab_size)
    n = min(cfg.eval_batches, n_windows // batch)
    engine.train(False)
    total = 0.0
    for _ in range(n):
        tok, tgt = loader.next()
        total += float(engine.global_loss(engine.eval_loss(tok, tgt)))
    engine.train(True)
    return total / max(n, 1)


def _strict(record: dict) -> dict:
    """``record`` with its inf/NaN numbers (the loss and norm of a skipped or diverged step)
    as None: ``json.dumps`` writes them as ``NaN``/``Infinity``, which is not JSON (jq and
    JSON.parse refuse the line)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()}


def _truncate_metrics(path: str, after_step: int, last: dict | None = None) -> None:
    """Drop lines of steps after ``after_step`` (left by a run killed after its checkpoint),
    and any line that is not a record (one cut short by a kill or a full disk); add ``last``,
    the checkpoint's own line of ``after_step``, where a kill between the checkpoint and the
    line lost it. The file is rewritten beside and renamed over, so a failure here (a full
    disk) leaves it as it was: a one-line ValueError naming ``--out``, nothing left beside."""
    if not os.path.isfile(path) and last is None:
        return
    keep, have_last = [], False
    with open(path, "a+") as f:
        f.seek(0)
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("step", 0) <= after_step:
                keep.append(json.dumps(_strict(rec)) + "\n")  # (NaN from before: null)
                have_last = have_last or rec.get("step") == after_step
    if last is not None and not have_last:
        keep.append(json.dumps(_strict(last)) + "\n")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())  # (before the rename: never an empty file after a crash)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ValueError(f"--out {os.path.dirname(path) or '.'}: rewriting metrics.jsonl failed "
                         f"({exc.strerror or exc}); it is as it was: free space there (then "
                         f"run again), or pass another --out") from None


def _banner(cfg: TrainConfig, mcfg, dims: ParallelDims, corpus) -> None:
    p = cfg.parallel
    sched = p.schedule if dims.pp > 1 else "-"
    _log(f"distllm train: {cfg.model} ({mcfg.num_params() / 1e6:.2f}M params), "
         f"tp{dims.tp}.pp{dims.pp}.dp{dims.dp}.zero{p.zero} schedule={sched} "
         f"micro_batches={p.micro_batches} dtype={cfg.dtype} world={dims.world_size}, "
         f"data={corpus.source} ({len(corpus.train) / 1e6:.1f}M train tokens)"
         + (f", weights from {cfg.init_from}" if cfg.init_from and not cfg.resume else ""), dims)


def _run_steps(cfg: TrainConfig, engine, loader, dims: ParallelDims, start: int, end: int,
               seq: int, result: TrainResult, corpus) -> None:
    from distllm.parallel.tensor import overlap_plans, overlap_tuning
    from distllm.train import checkpoint
    from distllm.train.stop_signal import StopSignal, parse_signals

    metrics = open(os.path.join(cfg.out, "metrics.jsonl"), "a") if dims.rank == 0 else None
    # the tensor-parallel layers' plans, found once (whether a trial runs is asked each step)
    plans = overlap_plans(engine.chunks)
    peak, _ = peak_flops(engine.dtype, dims.device)
    fpt = engine.mcfg.flops_per_token(seq)
    tokens_per_step = cfg.global_batch * seq
    bar = _Progress(cfg.steps, start, cfg.progress and dims.rank == 0)
    stop = StopSignal(parse_signals(cfg.save_on_signal), timeout=dims.timeout)
    result.steps_done = start
    told = False  # whether a validation said why it is skipped
    with contextlib.ExitStack() as scope:
        scope.callback(bar.close)
        if metrics is not None:
            scope.callback(metrics.close)
        scope.enter_context(stop)
        for step in range(start, end):
            lr = lr_at(step, cfg)
            engine.set_lr(lr)
            tok, tgt = loader.next()
            reducing = engine.reduction_tuning()  # the trial starts with the run: only ends
            tuning = overlap_tuning(plans) or reducing
            t0 = time.perf_counter()
            # the step's one host sync reads the loss, the norm and the inf/NaN flag together
            out = engine.update(cfg.optim.grad_clip, loss=engine.forward_backward(tok, tgt))
            loss, norm = out.loss, out.grad_norm
            dt = time.perf_counter() - t0
            result.losses.append(loss)
            tps = tokens_per_step / dt
            mfu = fpt * tps / (peak * dims.world_size)
            done = result.steps_done = step + 1
            # the checkpoint first (--save-every, and after the last step unless --no-save):
            # a validation that fails must not take the step's weights with it
            saved = bool(cfg.save_every and done % cfg.save_every == 0 and done < end
                         or done == end and cfg.save_final)
            record = _strict({"step": done, "loss": loss, "tokens_per_s": tps, "lr": lr,
                              "grad_norm": norm, "step_time_s": dt, "mfu": mfu,
                              "tokens": done * tokens_per_step,
                              "overlap_tuning": tuning or overlap_tuning(plans),
                              **({"skipped": True} if out.skipped else {})})
            if saved:  # with the step's line, which a resume writes if a kill lost it
                if metrics is not None:  # the lines before it on the device first: a power
                    metrics.flush()  # loss must not leave a checkpoint without its history
                    os.fsync(metrics.fileno())
                checkpoint.save(cfg.out, engine, loader, step=done, record=record)
            val = None
            try:
                if done == cfg.steps or cfg.eval_every and done % cfg.eval_every == 0:
                    val = _validate(engine, corpus, cfg, seq, dims, say=not told)
                    told = True
                    if val is not None:
                        result.val_losses[done] = val
                        result.val_loss = val if done == cfg.steps else None
            finally:  # the step's line, also when its validation failed
                if metrics is not None:
                    metrics.write(json.dumps(_strict(
                        {**record, **({} if val is None else {"val_loss": val})})) + "\n")
                    metrics.flush()
            if out.skipped:
                bar.write(f"step {done}: an inf/NaN gradient (norm {norm}): the optimizer "
                          f"did not step", dims)
            if reducing and not engine.reduction_tuning():  # it decided in this step
                bar.write(f"gradient reduction {engine.reduction_reason()}", dims)
            if val is not None and done < cfg.steps:
                bar.write(f"step {done}: validation loss {val:.4f}", dims)
            bar.update(f"loss {loss:.4f} | {tps:,.0f} tok/s | MFU {100 * mfu:.1f}%")
            # the ranks agree on a stop request; after the last step the run ends anyway
            result.stopped_by = stop.poll() if done < end else stop.settle()
            if result.stopped_by is not None:
                if not saved:
                    checkpoint.save(cfg.out, engine, loader, step=done, record=record)
                break


def train(cfg: TrainConfig, dims: ParallelDims | None = None) -> TrainResult:
    """Run ``cfg`` on the current ``torch.distributed`` world (started from torchrun's
    environment, or a 1-rank world, when ``dims`` is not given). ``cfg.out`` is checked first
    (:func:`~distllm.train.resume.check_out`), and a resume against its checkpoint
    (:func:`~distllm.train.resume.check_resume`: ``cfg`` is left as given, the run taking
    the checkpoint's schedule length). A world this call started
    is destroyed when the run ends: a process that exits with gloo's process group alive can
    abort in the interpreter's teardown ("terminate called without an active exception",
    seen on torch 2.11 after a finished run), and the launcher then reports a failed rank."""
    import torch.distributed as dist

    cfg = resolve_auto_resume(cfg)  # (a resume where --out holds a checkpoint)
    # (the world's rank: a caller's own world, else torchrun's, which counts with WORLD_SIZE)
    rank = (dims.rank if dims is not None else dist.get_rank() if dist.is_initialized()
            else int(os.environ["RANK"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ
            else 0)
    with out_lock(cfg.out, rank):  # (no other run into this --out while this one runs)
        check_out(cfg)  # (a fresh run into another run's --out would replace its checkpoints)
        if cfg.resume:  # (a copy: the checkpoint's schedule length is this run's alone)
            cfg = replace(cfg, optim=replace(cfg.optim))
            check_resume(cfg)
        started = dims is None and not dist.is_initialized()
        try:
            with _deterministic(cfg.deterministic):
                result = _train(cfg, dims)
        except (ValueError, FileNotFoundError):  # bad input, found alike on every rank: the
            if started and dist.is_initialized():  # world is idle, and ends as after a run
                dist.destroy_process_group()
            raise
        if started and dist.is_initialized():
            dist.destroy_process_group()
    return result


@contextlib.contextmanager
def _deterministic(on: bool):
    """``--deterministic`` for one run: torch's deterministic kernels, each ``auto`` GEMM
    backend by a fixed rule and overlap "auto" sequential (not by this machine's timing);
    undone when the run ends, so that a later run in the same process measures again."""
    if not on:
        yield
        return
    from distllm.ops import backend_choice
    from distllm.parallel.tensor import overlap_tuner

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              backend_choice.pinned(), overlap_tuner.pinned())
    torch.use_deterministic_algorithms(True)
    backend_choice.pin()
    overlap_tuner.pin()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if not before[2]:
            backend_choice.unpin()
        if not before[3]:
            overlap_tuner.unpin()


def _train(cfg: TrainConfig, dims: ParallelDims | None) -> TrainResult:
    from distllm.train import checkpoint
    from distllm.train.engine import Engine

    p = cfg.parallel
    if dims is None:
        dims = ParallelDims.from_layout(p, timeout_s=p.timeout_s)
    if cfg.keep_freed_memory and dims.device.type == "cpu":
        keep_freed_memory()
    mcfg = cfg.model_config()
    seq = cfg.seq_len or mcfg.max_seq_len
    check_layout(cfg, dims.world_size, n_layers=mcfg.n_layers, n_heads=mcfg.n_heads,
                 hidden=mcfg.hidden_size, seq_len=seq)
    check_init_from(cfg, mcfg)
    corpus = load_corpus(cfg.data, dtype=cfg.data_dtype, skip=cfg.out)
    check_same_data(corpus, dims)  # each rank read --data on its own machine
    check_vocab(corpus, mcfg.vocab_size, cfg.model)
    loader = BatchLoader(corpus.train, seq_len=seq, global_batch=cfg.global_batch, dp=dims.dp,
                         dp_rank=dims.dp_rank, seed=cfg.seed, vocab_size=mcfg.vocab_size)
    engine = Engine(cfg, mcfg, dims)
    engine.data_fingerprint = fingerprint(corpus)  # (recorded by, and checked against, checkpoints)
    result = TrainResult(baseline=math.log(mcfg.vocab_size))
    start = checkpoint.load_latest(cfg.out, engine, loader) if cfg.resume else 0
    if dims.rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        _banner(cfg, mcfg, dims, corpus)
        if cfg.resume:
            _log(f"resumed from step {start} ({cfg.out})", dims)
        # a fresh run starts a fresh metrics file; a resumed one drops steps after its start
        _truncate_metrics(os.path.join(cfg.out, "metrics.jsonl"), start,
                          checkpoint.record_of(cfg.out) if cfg.resume else None)
    planned = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    _run_steps(cfg, engine, loader, dims, start, planned, seq, result, corpus)
    end = result.steps_done  # before ``planned`` when a signal stopped the run
    if engine.zero is not None:  # nothing in flight when the run ends (ZeRO's gathers)
        engine.zero.wait_params()
        if dims.device.type == "cuda":  # (on NCCL a wait holds the stream, not the host)
            torch.cuda.synchronize(dims.device)
    if result.stopped_by is not None:  # saved at ``end`` (a stop always saves)
        if end < cfg.steps:
            _log(f"stopped by {result.stopped_by} after step {end} of {cfg.steps} "
                 f"(--save-on-signal): checkpoint saved in {cfg.out}; continue with --resume",
                 dims)
            return result
        _log(f"{result.stopped_by} came in the last step: the run is complete", dims)
    if end < cfg.steps:
        then = ("continue with --resume" if cfg.save_final else
                "nothing saved there (--no-save): --resume continues from an earlier "
                "checkpoint only (--save-every)")
        _log(f"stopped after step {end} of {cfg.steps} (--stop-after); {then}", dims)
        return result
    if result.val_loss is not None:  # validated after the last step
        _log(f"validation loss {result.val_loss:.4f} (uniform baseline ln({mcfg.vocab_size}) = "
             f"{result.baseline:.4f}) after {cfg.steps} steps", dims)
    return result
