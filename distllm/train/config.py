"""Typed configuration of a training run: parallel layout, optimiser, and the run itself.

Every field has a docstring (the string literal under it), from which ``distllm train``
(:mod:`distllm.train.cli`) generates its flags and their help; a field's ``metadata`` may
give its ``choices`` and, where the flag is not ``--<field-name>``, its ``flag``.
``__post_init__`` checks name the knob to change. Checks that need the world size
(``tp*pp*dp``) or the model (heads, layers) are in :func:`check_layout`.

The lists of choices live with what implements them: schedules in
:mod:`distllm.parallel.pipeline.schedules`, overlap modes in the tensor-parallel layers,
activation checkpointing and the vocabulary split in :mod:`distllm.models.gpt`; dtype names
in :mod:`distllm.dtypes`.
The planner's :class:`~distllm.plan.layout.Layout` converts to a :class:`ParallelConfig`
with :meth:`ParallelConfig.from_layout`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from distllm.models.config import CHECKPOINTING, VOCAB_PARALLEL, GPTConfig
from distllm.models.gpt import check_vocab_parallel
from distllm.parallel.pipeline.schedules import SCHEDULES, check_args
from distllm.parallel.tensor.layers import OVERLAP_MODES
from distllm.train.data import TOKEN_DTYPES
from distllm.train.stop_signal import parse_signals

if TYPE_CHECKING:
    from distllm.plan.layout import Layout

__all__ = [
    "ParallelConfig",
    "OptimConfig",
    "TrainConfig",
    "TRAIN_DTYPES",
    "check_layout",
    "check_init_from",
]

TRAIN_DTYPES = ("float32", "bfloat16", "float64")
"""The compute dtypes training runs (names of :data:`distllm.dtypes.DTYPES`)."""
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""After the warm-up: cosine or linear decay to ``lr * min_lr_ratio`` at the last step, a
constant ``lr``, or warm-up-stable-decay (``lr`` until the last ``decay_fraction`` of the
steps, then linear to ``lr * min_lr_ratio``; Hu et al. 2024, MiniCPM, arXiv:2404.06395)."""
ZERO_STAGES = (0, 1, 2, 3)
OVERLAP_GRAD_REDUCE = ("auto", "on", "off")
"""``--overlap-grad-reduce``: the data-parallel reduction during backward, after it, or the
trial's pick (:mod:`distllm.parallel.data.reduction_trial`)."""


def _choice(default: Any, choices: tuple, **meta: Any) -> Any:
    """A field whose value must be one of ``choices`` (checked in ``__post_init__``)."""
    return field(default=default, metadata={"choices": choices, **meta})


def _check_choices(obj: Any) -> None:
    for f in fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(obj, f.name) not in choices:
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            raise ValueError(f"{flag} {getattr(obj, f.name)!r}: choose one of "
                             f"{', '.join(map(str, choices))}")


MIN_TIMEOUT_S = 1.0  # below it the ranks time out in their own rendezvous
MAX_TIMEOUT_S = 1e8
"""The longest ``--timeout`` (about three years): a timedelta, and the launcher's integer
seconds, hold it."""

MAX_SEED = 2**32
"""Seeds are below this (the data order mixes the seed into a 64-bit integer)."""


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--{name.replace('_', '-')} {value!r}: it must be a positive "
                         f"integer")


@dataclass
class ParallelConfig:
    """How the model and the batch are split over ranks: the ``(pp, dp, tp)`` mesh."""

    tp: int = 1
    """Tensor-parallel size: ranks that split every weight matrix (consecutive ranks)."""
    pp: int = 1
    """Pipeline-parallel size: stages the layer list is cut into."""
    dp: int = -1
    """Data-parallel size; -1 takes every remaining rank (world // (tp*pp))."""
    zero: int = _choice(0, ZERO_STAGES)
    """ZeRO stage over the DP group: 0 = plain DDP, 1 = optimizer states sharded,
    2 = + gradients sharded, 3 = + parameters sharded."""
    schedule: str = _choice("1f1b", SCHEDULES)
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zb-h1 (pp > 1; the flag is refused
    at pp 1)."""
    micro_batches: int = 0
    """Micro-batches per step and DP rank; 0 picks pp (gpipe, 1f1b, zb-h1; 1 without a
    pipeline) or 2*pp (interleaved-1f1b)."""
    virtual_stages: int = 2
    """Model chunks per rank for interleaved-1f1b (the other schedules hold one; the flag is
    refused with them)."""
    sequence_parallel: bool = False
    """Keep LayerNorm/dropout activations sharded along the sequence inside a TP group (tp > 1;
    the flag is refused at tp 1)."""
    overlap: str = _choice("auto", OVERLAP_MODES)
    """Row-parallel GEMM + all-reduce overlap: auto (measured), chunked, or none (tp > 1;
    chunked or none is refused at tp 1)."""
    vocab_parallel: str = _choice("auto", VOCAB_PARALLEL)
    """Split the embedding and the head over TP along the vocabulary: auto (unless
    vocabulary * (tp - 1) <= 2 * hidden: then every TP rank holds them whole, with no
    collective), on, or off."""
    batch_split: int = 0
    """Batch-split overlap under TP (without sequence parallelism): the parts of each
    micro-batch the blocks run in turn, each part's row-parallel all-reduces hidden behind
    the next part's compute; 0 picks it (2 for evaluation on CPU, else 1), 1 turns it off
    (another value than 0 is refused at tp 1 and with --sequence-parallel)."""
    bucket_cap_mb: float = 25.0
    """Data-parallel gradient bucket size in MiB."""
    overlap_grad_reduce: str = _choice("auto", OVERLAP_GRAD_REDUCE)
    """Data-parallel gradient reduction: on (each bucket reduced as soon as it is full,
    during backward), off (every bucket after backward: the same buckets and collectives),
    or auto (on CPU at ZeRO stages 0-1 a trial in the first steps picks the faster; else
    on)."""
    timeout_s: float = field(default=300.0, metadata={"flag": "--timeout"})
    """Collective timeout in seconds: a dead rank ends the job after at most this long."""

    def __post_init__(self) -> None:
        _positive("tp", self.tp)
        _positive("pp", self.pp)
        if not isinstance(self.dp, int) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"--dp {self.dp!r}: it must be a positive integer, or -1 to infer "
                             f"it")
        _check_choices(self)
        if self.micro_batches < 0:
            raise ValueError(f"--micro-batches {self.micro_batches}: use 0 (auto) or a count "
                             f">= 1")
        if self.micro_batches == 0:
            self.micro_batches = 2 * self.pp if self.schedule == "interleaved-1f1b" else self.pp
        if self.pp > 1 and self.schedule in ("1f1b", "interleaved-1f1b", "zb-h1"):
            if self.micro_batches < self.pp:
                raise ValueError(
                    f"--micro-batches {self.micro_batches} < --pp {self.pp}: the {self.schedule} "
                    f"schedule needs at least pp micro-batches; raise --micro-batches to "
                    f">= {self.pp} or use --schedule gpipe"
                )
        if self.pp > 1 and self.schedule == "interleaved-1f1b" and self.virtual_stages >= 1:
            # before the ranks start: the schedule's own check (one chunk per rank,
            # micro-batches not a multiple of pp), naming the flags
            check_args(self.schedule, self.pp, self.micro_batches, self.virtual_stages)
        if self.zero == 3 and self.pp > 1 and self.schedule == "zb-h1":
            raise ValueError(
                "zero=3 with the zb-h1 schedule: its deferred weight gradients arrive after "
                "ZeRO-3 has released the parameters; use --zero 2 or lower, or another "
                "--schedule")
        _positive("virtual_stages", self.virtual_stages)
        if not isinstance(self.batch_split, int) or self.batch_split < 0:
            raise ValueError(f"--batch-split {self.batch_split!r}: use 0 (auto), 1 "
                             "(off) or the number of parts (>= 2)")
        check_vocab_parallel(self.vocab_parallel, self.tp, self.sequence_parallel)
        if not 0 < self.bucket_cap_mb < math.inf:
            raise ValueError(f"--bucket-cap-mb {self.bucket_cap_mb}: it must be a finite size "
                             f"> 0 MiB (25 is the default)")
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"--timeout {self.timeout_s}: it must be at least "
                             f"{MIN_TIMEOUT_S:.0f} s (the ranks' start and each collective wait "
                             f"up to it; 300 is the default), at most {MAX_TIMEOUT_S:.0e}")

    @property
    def grad_reduce_overlap(self) -> bool | str:
        """:attr:`overlap_grad_reduce` as the data-parallel classes take it."""
        return {"on": True, "off": False, "auto": "auto"}[self.overlap_grad_reduce]

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks a pipeline rank holds (v for interleaved-1f1b, else 1)."""
        return self.virtual_stages if (self.pp > 1 and self.schedule == "interleaved-1f1b") else 1

    def layout(self) -> str:
        """Short name of the layout, e.g. ``tp2.pp2.dp1.zero0``."""
        return f"tp{self.tp}.pp{self.pp}.dp{self.dp}.zero{self.zero}"

    @classmethod
    def from_layout(cls, layout: Layout, base: ParallelConfig | None = None) -> ParallelConfig:
        """The training layout that runs the planner's ``layout``: its sizes, ZeRO stage,
        micro-batches and sequence parallelism, and with pp > 1 its schedule and virtual
        stages. What a ``Layout`` does not decide (the overlap mode, the bucket size, the
        timeout, and the schedule when pp = 1) comes from ``base`` (default: the defaults).
        Activation checkpointing is a field of :class:`TrainConfig`:
        ``layout.checkpointing``."""
        kw: dict[str, Any] = dict(tp=layout.tp, pp=layout.pp, dp=layout.dp, zero=layout.zero,
                                  micro_batches=layout.micro_batches,
                                  sequence_parallel=layout.sequence_parallel)
        if layout.pp > 1:
            kw["schedule"] = layout.schedule
            if layout.schedule == "interleaved-1f1b":
                kw["virtual_stages"] = layout.virtual_stages
        return replace(base or cls(), **kw)


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a decay (cosine by default), and global-norm gradient
    clipping."""

    lr: float = 3e-3
    """Peak learning rate, reached after the warm-up."""
    lr_schedule: str = _choice("cosine", LR_SCHEDULES)
    """After the warm-up: cosine or linear decay to lr * min_lr_ratio at the last step,
    constant, or wsd (constant, then linear over the last --decay-fraction of the steps)."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr * min_lr_ratio at the last step."""
    decay_fraction: float = 0.2
    """wsd: the share of the steps, at the end, over which the learning rate decays."""
    warmup_steps: int = -1
    """Linear warm-up steps, fewer than the schedule's (--lr-decay-steps, else --steps); -1
    uses 5% of the schedule's steps (at least 1)."""
    lr_decay_steps: int = 0
    """Steps the learning-rate schedule spans (warm-up and decay; after them it stays at its
    end value); 0: --steps, or on --resume the checkpoint's."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on weight matrices (not on biases, norms or the position
    embedding wpe)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (across TP, PP and DP) to this; 0 disables clipping."""

    def schedule(self, steps: int) -> dict[str, float | int | str]:
        """These settings with the schedule's length resolved for a run of ``steps``:
        ``lr_decay_steps`` (0 -> ``steps``) and ``warmup_steps`` (-1 -> 5% of them, at least
        1): what a checkpoint records, and what a resume compares."""
        out = asdict(self)
        horizon = self.lr_decay_steps or steps
        out["lr_decay_steps"] = horizon
        if self.warmup_steps == -1:
            out["warmup_steps"] = max(1, round(0.05 * horizon))
        return out

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr {self.lr}: it must be a positive finite number")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: choose a value in [0, 1]")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"--weight-decay {self.weight_decay}: it must be finite and >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: choose a value in [0, 1)")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"--eps {self.eps}: it must be finite and > 0 (1e-8 is the "
                             f"default): 0 divides by zero where a gradient is 0")
        if not 0 <= self.grad_clip < math.inf:
            raise ValueError(f"--grad-clip {self.grad_clip}: use 0 to disable, or a positive "
                             f"finite norm")
        if not isinstance(self.lr_decay_steps, int) or self.lr_decay_steps < 0:
            raise ValueError(f"--lr-decay-steps {self.lr_decay_steps}: use 0 (--steps) or a "
                             f"positive step count")
        if self.warmup_steps < -1:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: use -1 (auto) or >= 0")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"--decay-fraction {self.decay_fraction}: choose a share of the "
                             f"steps in (0, 1]")


def _check_warmup(optim: OptimConfig, steps: int) -> None:
    """A warm-up given (not -1) must end before the schedule's last step: the schedule's
    steps from the warm-up's end on are its decay, which ends at ``lr * min_lr_ratio`` on
    that last step (a longer warm-up trains at a fraction of ``lr`` throughout, then jumps
    to the decay's end once the schedule is over)."""
    horizon = optim.lr_decay_steps or steps
    if optim.warmup_steps < horizon:
        return
    flag = "--lr-decay-steps" if optim.lr_decay_steps else "--steps"
    raise ValueError(f"--warmup-steps {optim.warmup_steps}: the warm-up must end before the "
                     f"learning-rate schedule's last step ({flag} {horizon}); lower "
                     f"--warmup-steps below {horizon}, or raise {flag}")


@dataclass
class TrainConfig:
    """One training run."""

    model: str = "tiny"
    """GPT preset name (see ``distllm.models.GPTConfig.presets()``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    global_batch: int = 32
    """Sequences per optimizer step, over all DP ranks and micro-batches."""
    seq_len: int = 0
    """Tokens per sequence; 0 uses the preset's context length."""
    steps: int = 300
    """Optimizer steps to run (in total, counting steps done before a resume)."""
    seed: int = 1234
    """Seed of the initial weights and of the data order. A resume keeps its checkpoint's
    (its data order goes on): another one given with ``--resume`` is refused."""
    dtype: str = _choice("float32", TRAIN_DTYPES)
    """Compute dtype: float32, bfloat16 (with fp32 master weights) or float64."""
    activation_checkpointing: str = _choice("none", CHECKPOINTING)
    """Recompute activations in backward: none, selective (attention core) or full (blocks)."""
    data: str | None = None
    """A text file or a folder of text files (read as bytes), a .bin file of token ids, or a
    folder holding train.bin (and val.bin); None uses the Python standard library's sources."""
    data_dtype: str = _choice("uint16", TOKEN_DTYPES)
    """The dtype of a .bin file's token ids (nanoGPT writes uint16; another is refused for
    text data)."""
    out: str = "runs/train"
    """Output folder: metrics.jsonl and checkpoints."""
    resume: bool = False
    """Resume from the newest complete checkpoint in ``out``."""
    auto_resume: bool = False
    """Resume when ``out`` holds a complete checkpoint, else start the run: one command for
    a job's first attempt and its restarts (torchrun --max-restarts, a SLURM requeue); with
    no checkpoint, another run's metrics.jsonl in ``out`` is refused as for any fresh run."""
    n_layers: int = 0
    """Override the preset's number of transformer blocks (0: the preset's)."""
    init_from: str | None = None
    """A Hugging Face GPT-2 folder (config.json and weights, as save_pretrained writes them)
    whose weights start a fresh run (fine-tuning); --model names its shape (gpt2-small for
    GPT-2's 124M). Needs transformers. With --resume the checkpoint holds the weights and
    this is not read (the fine-tuning command with --resume added continues it)."""
    stop_after: int = 0
    """Stop this run after this many steps in total (0: run to ``steps``), saving a
    checkpoint there (unless --no-save); the learning-rate schedule still spans ``steps``
    (for preemptible jobs that continue with --resume)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep only this many of the newest checkpoints in ``out`` (0: keep all)."""
    save_final: bool = field(default=True, metadata={"flag": "--no-save"})
    """Save a checkpoint after the last step."""
    save_on_signal: str = "SIGTERM,SIGUSR1"
    """Signals that stop the run after the step in flight with a checkpoint (comma-separated:
    SIGTERM, SIGUSR1, SIGUSR2; none: off), for preemptible jobs: a scheduler's SIGTERM, or
    SLURM's ``--signal=USR1@SECONDS``. Continue with --resume."""
    eval_batches: int = 8
    """Global batches of held-out data used for the validation loss at the end (0: none);
    held-out data smaller than one global batch gives one smaller batch."""
    eval_every: int = 0
    """Also validate every this many steps (0: only at the end); each validation loss is in
    its step's line of metrics.jsonl (``val_loss``)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    deterministic: bool = False
    """Ask torch for deterministic kernels, pick each ``auto`` GEMM backend by a fixed rule
    and run ``--overlap auto`` as none, instead of timing (the same kernels and schedules in
    every run and after --resume: exact resume in float32; --overlap chunked stays a fixed
    overlap)."""
    override_optim: bool = False
    """On --resume, train on with this command's optimizer and learning-rate settings where
    they differ from the checkpoint's (without it such a resume is refused), and with the
    schedule spanning --steps unless --lr-decay-steps says otherwise."""
    override_data: bool = False
    """On --resume, train on with this command's --data where it differs from the data the
    checkpoint trained on (without it such a resume is refused), from that data's start."""
    keep_freed_memory: bool = True
    """On CPU, have glibc keep freed memory instead of returning it to the kernel, so that a
    step does not page-fault in what the last one freed (ZeRO-2's gradient buckets, the
    activations); see :mod:`distllm.train.host_memory`."""

    def __post_init__(self) -> None:
        _positive("global_batch", self.global_batch)
        if self.seq_len < 0:
            raise ValueError(f"--seq-len {self.seq_len}: use 0 (the preset's) or a positive "
                             f"length")
        _positive("steps", self.steps)
        _check_choices(self)
        if self.n_layers < 0:
            raise ValueError(f"--n-layers {self.n_layers}: use 0 (the preset's) or a positive "
                             f"depth")
        if self.stop_after < 0:
            raise ValueError(f"--stop-after {self.stop_after}: use 0 (run to --steps) or a step")
        if not str(self.out).strip():
            raise ValueError(f"--out {self.out!r}: name the run's folder")
        if not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"--seed {self.seed!r}: choose a seed in [0, 2**32)")
        if (self.activation_checkpointing != "none" and self.parallel.pp > 1
                and self.parallel.schedule == "zb-h1"):
            raise ValueError(
                "activation_checkpointing with the zb-h1 schedule: its deferred weight "
                "gradients do not survive recomputation; use --activation-checkpointing none "
                "or another --schedule")
        if self.keep_checkpoints < 0:
            raise ValueError(f"--keep-checkpoints {self.keep_checkpoints}: use 0 (keep all) or "
                             f"a count")
        if self.save_every < 0:
            raise ValueError(f"--save-every {self.save_every}: use 0 (end only) or a step "
                             f"count")
        parse_signals(self.save_on_signal)
        if self.eval_batches < 0:
            raise ValueError(f"--eval-batches {self.eval_batches}: it must be >= 0")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every {self.eval_every}: use 0 (the end only) or a step "
                             f"count")
        if self.eval_every and not self.eval_batches:
            raise ValueError(f"--eval-every {self.eval_every} with --eval-batches 0: validation "
                             f"is off; raise --eval-batches, or drop --eval-every")
        _check_warmup(self.optim, self.steps)

    def to_dict(self) -> dict:
        return asdict(self)

    def model_config(self) -> GPTConfig:
        """The ``GPTConfig`` of ``model`` with this run's overrides."""
        over = {"n_layers": self.n_layers} if self.n_layers else {}
        return GPTConfig.preset(self.model, **over)


def check_layout(cfg: TrainConfig, world: int, *, n_layers: int, n_heads: int, hidden: int,
                 seq_len: int) -> int:
    """Checks that need the world size and the model (``n_layers`` transformer blocks);
    returns the resolved ``dp``."""
    p = cfg.parallel
    if world % (p.tp * p.pp) != 0:
        raise ValueError(
            f"tp*pp = {p.tp}*{p.pp} = {p.tp * p.pp} does not divide the world size {world}: "
            f"choose --tp/--pp whose product divides {world}, or change the number of ranks "
            f"(--nproc, or torchrun's --nnodes x --nproc-per-node)"
        )
    dp = world // (p.tp * p.pp) if p.dp == -1 else p.dp
    if p.tp * p.pp * dp != world:
        raise ValueError(
            f"tp*pp*dp = {p.tp}*{p.pp}*{dp} = {p.tp * p.pp * dp} does not match the world size "
            f"{world}: set --dp -1 to infer it, or make the product {world}"
        )
    if n_heads % p.tp or hidden % p.tp:
        raise ValueError(
            f"the model has {n_heads} heads and hidden size {hidden}, not divisible by --tp "
            f"{p.tp}: choose --tp dividing {n_heads}"
        )
    chunks = p.pp * p.chunks_per_rank
    if n_layers + 2 < chunks:  # the pipeline splits [embedding, blocks..., head]
        raise ValueError(
            f"the model's {n_layers + 2} pipeline layers (embedding, {n_layers} blocks, head) "
            f"cannot fill pp*v = {chunks} pipeline chunks: lower --pp (or --virtual-stages), "
            f"or use a deeper model (--n-layers)"
        )
    per_rank = cfg.global_batch // dp if cfg.global_batch % dp == 0 else 0
    if per_rank == 0 or per_rank % p.micro_batches:
        raise ValueError(
            f"--global-batch {cfg.global_batch} is not divisible by dp*micro_batches = "
            f"{dp}*{p.micro_batches} = {dp * p.micro_batches}: choose --global-batch a multiple "
            f"of {dp * p.micro_batches}, or change --micro-batches"
        )
    if p.sequence_parallel and seq_len % p.tp:
        raise ValueError(
            f"--seq-len {seq_len} is not divisible by --tp {p.tp}, which sequence parallelism "
            f"needs: choose --seq-len a multiple of {p.tp} or drop --sequence-parallel"
        )
    return dp


def check_init_from(cfg: TrainConfig, mcfg: GPTConfig) -> None:
    """Checks of ``--init-from`` that need only the folder's ``config.json``, before any
    model is built (the launcher's precheck and :func:`~distllm.train.trainer.train` both
    run them): the folder's model is ``mcfg`` (``--model``), and the data's tokens are the
    ones it reads. None for a run without ``--init-from`` or resuming."""
    if not cfg.init_from or cfg.resume:
        return
    from distllm.models.hf import check_pretrained_shape, pretrained_config
    from distllm.train.tokenize_data import check_pretrained_tokens

    check_pretrained_shape(pretrained_config(cfg.init_from), mcfg, cfg.model, cfg.init_from)
    check_pretrained_tokens(cfg.init_from, mcfg.vocab_size, cfg.data)
