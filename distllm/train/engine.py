"""Assembly of one rank's share of the training job: its GPT layers (TP inside), the pipeline
executor (PP), the data-parallel wrapper or ZeRO optimizer (DP), and AdamW.

``Engine.forward_backward(tokens, targets)`` (or ``train_step``, which reads the loss back)
runs the forward and backward of one global batch's share of this rank (all micro-batches)
and leaves DP-synchronised gradients; ``Engine.update(max_norm, loss)`` (or ``step``) clips
by the global norm (over TP, PP and DP) and steps.
Every tensor that meets a collective lives on the mesh's device, and a step reads the device
from the host once (the loss, the gradient norm and the inf/NaN flag together).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from distllm.comm.collectives import all_reduce
from distllm.dtypes import DTYPES as DTYPE
from distllm.models.config import GPTConfig
from distllm.models.gpt import GPT
from distllm.parallel.mesh import ParallelDims
from distllm.parallel.pipeline import split_micro_batches
from distllm.train.config import TrainConfig

__all__ = ["Engine", "DTYPE", "StepMetrics", "stage_layer_ids"]


def _all_chunk_ids(n_layers: int, pp: int, v: int) -> list[list[int]]:
    """Layer indices of the ``pp * v`` pipeline chunks in stage order, as even as possible,
    earlier chunks taking the remainder (as ``split_layers`` does without interleaving)."""
    base, extra = divmod(n_layers, pp * v)
    out, lo = [], 0
    for c in range(pp * v):
        hi = lo + base + (1 if c < extra else 0)
        out.append(list(range(lo, hi)))
        lo = hi
    return out


def stage_layer_ids(n_layers: int, pp: int, v: int, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each model chunk held by ``pp_rank`` (stage ``s`` of the
    ``pp * v`` stages runs on rank ``s % pp`` as its chunk ``s // pp``)."""
    return _all_chunk_ids(n_layers, pp, v)[pp_rank::pp]


def _decay_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on biases, norms and position embeddings.

    Decided from each parameter's name and shape, so it must see the parameters as the
    model built them: before ZeRO-3 packs them into shards (a sharded parameter reads as an
    empty 1-D tensor)."""
    if any(p.numel() == 0 for _, p in params):
        raise RuntimeError("decay groups are decided from parameter shapes: build them before "
                           "ZeroOptimizer(stage=3) shards the parameters")

    def decays(n: str, p: nn.Parameter) -> bool:
        return p.dim() >= 2 and not n.endswith("wpe")

    decay = [p for n, p in params if decays(n, p)]
    no_decay = [p for n, p in params if not decays(n, p)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """``module``'s buffers to ``device``, its parameters left where they are (on the meta
    device, for ZeRO-3 to materialise a layer at a time)."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch's host tensor on ``device``. On a GPU through pinned memory and without
    blocking: a copy from pageable memory makes the host wait for the stream first (the
    previous step's optimizer kernels), and the next step's kernels queue only after."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class StepMetrics:
    """What :meth:`Engine.update` read back from the device (its one host sync)."""

    loss: float  # the global loss (Engine.global_loss); nan when update() was given none
    grad_norm: float  # before clipping
    skipped: bool  # a gradient was inf/NaN: the optimizer did not step (on every rank)


class Engine:
    """One rank's model chunks, pipeline, DP wrapper and optimizer."""

    def __init__(self, cfg: TrainConfig, mcfg: GPTConfig, dims: ParallelDims):
        self.cfg, self.mcfg, self.dims = cfg, mcfg, dims
        self.dtype = DTYPE[cfg.dtype]
        p = cfg.parallel
        self.v = p.chunks_per_rank
        self.chunk_ids = stage_layer_ids(mcfg.n_pipeline_layers, dims.pp, self.v, dims.pp_rank)
        kw = dict(sequence_parallel=p.sequence_parallel, overlap=p.overlap,
                  vocab_parallel=p.vocab_parallel, batch_split=p.batch_split or "auto",
                  activation_checkpointing=cfg.activation_checkpointing, dtype=self.dtype)
        # GPT-2's init draws every layer's full tensors in float64 (about 30M values/s on a
        # CPU core, 53 s for gpt2-xl): skipped where every weight is replaced next (a
        # resume's checkpoint, --init-from's weights)
        seed = None if cfg.resume or cfg.init_from else cfg.seed
        self.device = dims.device  # cuda under NCCL, else cpu
        # ZeRO-3 never holds the whole stage: its parameters are built on the meta device and
        # each layer is materialised, initialised and sharded in turn (ZeroOptimizer's
        # param_init_fn); the rest build and initialise the stage here
        deferred = p.zero == 3
        with torch.device("meta") if deferred else contextlib.nullcontext():
            # one GPT per model chunk (v > 1 only for the interleaved schedule)
            self.chunks = [GPT(mcfg, dims, layer_ids=ids, seed=None if deferred else seed, **kw)
                           for ids in self.chunk_ids]
        for c in self.chunks:
            if deferred:
                move_buffers(c, self.device)
            else:
                c.to(self.device)
        self._build_dp_and_optimizer(self._init_unit(seed) if deferred else None)
        self.pipeline = self._build_pipeline() if dims.pp > 1 else None
        # the positions whose embeddings have been trained (a checkpoint records it, so that
        # `distllm sample` keeps to them): this run's sequence, or every position of
        # pretrained weights; a resume takes the larger of this and its checkpoint's (all of
        # them for a checkpoint from before the record)
        self.trained_positions = (mcfg.max_seq_len if cfg.init_from and not cfg.resume
                                  else cfg.seq_len or mcfg.max_seq_len)
        # the training data's fingerprint (distllm.train.data.fingerprint), which the trainer
        # sets: a checkpoint records it, and a resume on other contents is refused
        self.data_fingerprint: list[int] | None = None
        if cfg.init_from and not cfg.resume:  # a resumed run takes its checkpoint's weights
            from distllm.models.hf import pretrained_layers
            from distllm.train.checkpoint import install_weights

            install_weights(self, pretrained_layers(cfg.init_from, mcfg, cfg.model))

    # --- data parallel + optimizer -----------------------------------------------------
    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for c in self.chunks for n, p in c.named_parameters()]

    def _init_unit(self, seed: int | None):
        """ZeRO-3's ``param_init_fn``: the GPT-2 initialisation of one unit's parameters
        (nothing where a checkpoint or pretrained weights replace them next)."""
        from distllm.models.sharding import init_params

        def init(unit: nn.Module, params: list[nn.Parameter]) -> None:
            if seed is None:
                return
            for c in self.chunks:  # (the new parameters, already in the chunk)
                held = {id(p) for p in c.parameters()}
                mine = [p for p in params if id(p) in held]
                if mine:
                    init_params(c, mine, seed)
        return init

    def _build_dp_and_optimizer(self, param_init_fn) -> None:
        """``param_init_fn``: ZeRO-3's, for chunks built on the meta device (else None)."""
        o, p = self.cfg.optim, self.cfg.parallel
        # torch's fused AdamW: one pass per tensor, no temporaries (on one CPU core at 43M
        # parameters 32 ms a step, against 198 ms for foreach=True and 111 ms for the loop)
        adam = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        groups = _decay_groups(self._named_params(), o.weight_decay)
        self.module = self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)
        finish_on_end = self.dims.pp == 1
        if p.zero == 0 and self.dtype != torch.bfloat16:
            from distllm.parallel.data.ddp import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.module, dims=self.dims, bucket_cap_mb=p.bucket_cap_mb,
                finish_on_backward_end=finish_on_end, overlap_grad_reduce=p.grad_reduce_overlap,
                broadcast_buffers=False)  # (the GPT's one buffer, its vocabulary padding
            # mask, is the same on every rank: no broadcast at each forward)
            self.grad_sync = self.ddp
            self.optimizer = torch.optim.AdamW(groups, **adam)
            self.zero = None
            return
        # ZeRO stages 1-3, and bf16 at stage 0 (fp32 master weights live in ZeroOptimizer)
        from distllm.parallel.data.zero import ZeroOptimizer

        self.ddp = None
        # stages 1-3 take the module, with the same decay / no-decay groups (decided above,
        # before anything is sharded): stage 3 gathers layers by its module hooks, stages
        # 1-2 wait for each bucket's parameter all-gather (launched by the step) in a
        # forward pre-hook of the layers (units) that use it, so the gathers overlap the
        # next forward instead of ending the step
        by_module = p.zero >= 1
        units = [layer for c in self.chunks for layer in c.layer_list()] if by_module else None
        self.zero = ZeroOptimizer(self.module if by_module else groups, torch.optim.AdamW,
                                  stage=p.zero, dims=self.dims,
                                  param_groups=groups if by_module else None,
                                  bucket_cap_mb=p.bucket_cap_mb, units=units,
                                  finish_on_backward_end=finish_on_end,
                                  overlap_grad_reduce=p.grad_reduce_overlap,
                                  param_init_fn=param_init_fn,
                                  **adam)
        self.grad_sync = self.zero
        self.optimizer = self.zero

    def reduction_tuning(self) -> bool:
        """Whether the data-parallel gradient reduction is in ``--overlap-grad-reduce
        auto``'s trial (its steps alternate between reducing during and after backward)."""
        reducer = getattr(self.grad_sync, "reducer", None)
        return reducer is not None and reducer.tuning

    def reduction_reason(self) -> str | None:
        """How the data-parallel gradient reduction runs and why (the trial's decision and
        its figures under ``--overlap-grad-reduce auto``); None without one."""
        reducer = getattr(self.grad_sync, "reducer", None)
        return None if reducer is None else reducer.overlap_reason

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def set_lr(self, lr: float) -> None:
        for g in self.param_groups():
            g["lr"] = lr

    # --- pipeline ------------------------------------------------------------------------
    def _build_pipeline(self):
        """The pipeline executor over this rank's already-built layers; its DP contract is
        ``grad_sync`` (DDP or ZeroOptimizer)."""
        from distllm.parallel.pipeline.executor import PipelineParallel

        p = self.cfg.parallel
        n = self.mcfg.n_pipeline_layers
        counts = [len(ids) for ids in _all_chunk_ids(n, self.dims.pp, self.v)]
        built = {i: c.layers[str(i)] for c in self.chunks for i in c.layer_ids}
        # a chunk's GPT.forward runs batch-split overlap where it applies (TP without SP;
        # ZeRO-3's gathering blocks are not split): the stage runs it, not its bare layers
        split = self.chunks[0].batch_split != 1 and p.zero != 3
        pipe = PipelineParallel(built.__getitem__, self.dims, schedule=p.schedule,
                                micro_batches=p.micro_batches, virtual_stages=self.v,
                                layers_per_stage=counts, num_layers=n,
                                grad_sync=self.grad_sync,
                                run_chunk=(lambda c, x: self.chunks[c](x)) if split else None)
        if pipe.layer_ids != self.chunk_ids:
            raise AssertionError(f"pipeline split {pipe.layer_ids} != {self.chunk_ids}")
        return pipe

    # --- one step ------------------------------------------------------------------------
    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward + backward of this rank's rows of the global batch; returns the mean loss
        over them on the last stage (0.0 elsewhere). Reading it is a host sync: a training
        loop calls :meth:`forward_backward` and :meth:`update`, which read once per step."""
        return float(self.forward_backward(tokens, targets))

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`train_step` with the loss left on the device: a float64 scalar (no host
        sync; pass it to :meth:`update`). On a GPU, host batches are copied without blocking
        (:func:`to_device`): a batch already in pinned memory is read as the copy runs, so
        do not refill it before the step's :meth:`update` (the loader gives a new tensor
        each step)."""
        tokens, targets = to_device(tokens, self.device), to_device(targets, self.device)
        if self.pipeline is not None:  # the last stage's loss, 0 elsewhere: update()
            # reduces it over the world with the step's other metrics (no broadcast first)
            return self.pipeline.train_step_tensor(tokens, targets, self._loss,
                                                   broadcast=False)
        m = self.cfg.parallel.micro_batches
        model = self.chunks[0]
        total: torch.Tensor | None = None
        mbs = zip(split_micro_batches(tokens, m, "the batch"),
                  split_micro_batches(targets, m, "the targets"), strict=True)
        for k, (tok, tgt) in enumerate(mbs):
            ctx = self.grad_sync.no_sync() if k < m - 1 else contextlib.nullcontext()
            with ctx:
                loss = model.loss(self._forward(model, tok), tgt)
                (loss / m).backward()
            part = loss.detach().to(torch.float64)
            total = part if total is None else total + part
        self.grad_sync.finish_grad_sync()
        return total / m

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.chunks[-1].loss(logits, targets)

    def _forward(self, model: GPT, tok: torch.Tensor) -> torch.Tensor:
        return self.ddp(tok) if self.ddp is not None else model(tok)

    def global_loss(self, local: torch.Tensor | float) -> torch.Tensor:
        """The step's loss, the same on every rank, as a float64 scalar on the device: the
        last stage's TP-rank-0 values of ``local`` (this rank's loss) averaged over DP.
        Collective: one all-reduce over the world group (world size > 1)."""
        d = self.dims
        mine = self._loss_share(local)
        if d.world_size > 1:
            all_reduce(mine, group=d.world_group)
        return mine[0] / d.dp

    def _loss_share(self, local: torch.Tensor | float) -> torch.Tensor:
        """This rank's term of the world sum behind :meth:`global_loss`: its loss on the last
        stage's TP rank 0, else 0 (a float64 1-element tensor on the device)."""
        d = self.dims
        mine = torch.as_tensor(local, dtype=torch.float64, device=self.device).reshape(1).clone()
        return mine if d.is_last_stage and d.tp_rank == 0 else torch.zeros_like(mine)

    def step(self, max_norm: float) -> float:
        """:meth:`update` without a loss; returns the gradient norm before clipping."""
        return self.update(max_norm).grad_norm

    def update(self, max_norm: float, loss: torch.Tensor | None = None) -> StepMetrics:
        """Clip by the global gradient norm (``max_norm <= 0``: no clipping), step AdamW
        unless a gradient is inf/NaN on some rank (ZeRO: its flag; DDP: the global norm,
        the same on every rank, is not finite), zero the gradients.

        ``loss``: this rank's :meth:`forward_backward` loss, reduced by :meth:`global_loss`.
        The norm, the loss and the inf/NaN flag are read back together: the step's one host
        sync. Collectives: one all-reduce over the world group carries the norm's squares
        and the loss (with ZeRO the inf/NaN flags too); without a loss, DDP's norm is reduced
        over TP x PP.
        """
        max_norm = max_norm if max_norm > 0 else float("inf")
        if self.zero is not None:
            share = self._loss_share(loss) if loss is not None else None
            norm, flag, total = self.zero.clip_and_check(max_norm, share)
            vals = {"grad_norm": norm.to(torch.float64), "found_inf": flag.to(torch.float64)}
            if total is not None:
                vals["loss"] = total[0] / self.dims.dp
        elif loss is not None:  # the norm's squares and the loss in one all-reduce
            norm, summed = self.ddp.clip_grad_norm_and_sum_(max_norm, self._loss_share(loss))
            vals = {"grad_norm": norm, "loss": summed[0] / self.dims.dp}
        else:
            vals = {"grad_norm": self.ddp.clip_grad_norm_(max_norm).to(torch.float64)}
        read = dict(zip(vals, torch.stack(list(vals.values())).tolist(), strict=True))
        # DDP: an inf/NaN gradient anywhere makes the global norm inf/NaN on every rank
        skipped = (bool(read["found_inf"]) if "found_inf" in read
                   else not math.isfinite(read["grad_norm"]))
        if self.zero is not None:
            self.zero.step(found_inf=skipped)
            self.zero.zero_grad()
        else:
            if not skipped:
                self.optimizer.step()
            self.ddp.zero_grad()
        return StepMetrics(loss=read.get("loss", float("nan")), grad_norm=read["grad_norm"],
                           skipped=skipped)

    # --- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss of this DP rank's rows, forward only (the pipeline's forward-only
        schedule with pp > 1, as many micro-batches as in training, of any size: each
        activation carries its shape); the same on every rank of the pipeline."""
        tokens, targets = to_device(tokens, self.device), to_device(targets, self.device)
        if self.pipeline is not None:
            return self.pipeline.eval_step(tokens, targets, self._loss)
        model = self.chunks[0]
        return float(model.loss(self._forward(model, tokens), targets))

    def train(self, mode: bool = True) -> None:
        for c in self.chunks:
            c.train(mode)
