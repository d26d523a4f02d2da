"""``PipelineParallel``: one executor that runs any pipeline schedule over the local stages.

Communication: point-to-point only, between the same ``(dp, tp)`` coordinates of neighbouring
pipeline ranks (batched async ``isend``/``irecv``, see ``pp_comm``); at the end of a step the
loss is broadcast over ``dims.pp_group`` from the last stage. A stage's modules may be
tensor-parallel (their own collectives run inside F/B/W, identically on every TP rank).
Data parallelism composes through ``grad_sync`` (``no_sync()`` / ``finish_grad_sync()``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from distllm.comm.collectives import backend_for
from distllm.ops.weight_grad import DeferLinearWeightGrads, WeightGradStore
from distllm.parallel.pipeline.pp_comm import StageComm, p2p_channel_groups
from distllm.parallel.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    W,
    build_schedule,
    forward_only_schedule,
)
from distllm.parallel.pipeline.simulate import message_of
from distllm.parallel.pipeline.stage import split_layers

__all__ = ["PipelineParallel", "StepStats", "split_micro_batches"]

LayerSpec = Sequence[nn.Module] | Callable[[int], nn.Module]


@dataclass
class StepStats:
    """What the last step did on this rank.

    ``timeline``: ``(action, t_start, t_end)`` per compute action (``time.perf_counter``,
    start taken once the input has arrived); ``wait_s``: time blocked waiting for messages;
    the rest of ``t_end - t_start`` outside the timeline is host overhead;
    ``peak_activations``: most micro-batches whose activations were held at once (a chunk
    counts ``1/virtual_stages``);
    ``peak_activation_bytes``: the most bytes autograd held saved for backward (parameters
    excluded), measured only with ``track_memory``.
    """

    t_start: float = 0.0
    t_end: float = 0.0
    wait_s: float = 0.0  # blocked on receives and on the end-of-step sends
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    peak_activations: float = 0.0
    peak_activation_bytes: int = 0


def split_micro_batches(t: torch.Tensor, m: int, what: str,
                        knob: str = "--micro-batches") -> list[torch.Tensor]:
    """``t`` split into ``m`` equal micro-batches along dim 0 (error naming ``knob`` if not)."""
    n = t.size(0)
    if n % m:
        ok = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"{what} has {n} samples, not divisible by {knob}={m}: "
                         f"choose {knob} in {ok}, or a batch size divisible by {m}")
    return list(t.split(n // m))


def _refuse_weights_across_ranks(layers: Sequence[nn.Module], ranges, pp: int) -> None:
    """A parameter in layers that land on different pipeline ranks (a weight tied between
    the embedding and the head, say) would get each rank's part of its gradient only, and
    its copies would drift apart from the first step on: refused, naming the layers."""
    rank_of = {i: s % pp for s, r in enumerate(ranges) for i in r}
    seen: dict[int, tuple[int, str]] = {}  # id(param) -> (its first layer, its name there)
    for i, layer in enumerate(layers):
        for name, q in layer.named_parameters(remove_duplicate=False):
            first = seen.setdefault(id(q), (i, name))
            if rank_of[first[0]] != rank_of[i]:
                raise ValueError(
                    f"layers {first[0]} ({first[1]}) and {i} ({name}) share a parameter, and "
                    f"the pipeline puts them on pipeline ranks {rank_of[first[0]]} and "
                    f"{rank_of[i]}: the pipeline does not sum a weight's gradient across "
                    f"ranks; untie the weight, or place both layers on one rank "
                    f"(layers_per_stage)")


class PipelineParallel(nn.Module):
    """The local pipeline stages of a model given as a sequence of layers, and its executor.

    Args:
        layers: the whole model's layers ``[embedding, blocks..., head]`` (only this rank's
            are kept; a parameter shared by layers on different pipeline ranks is refused),
            or ``layer_fn(i) -> nn.Module`` building layer ``i`` (then give ``num_layers``;
            only this rank's layers are built, so nothing can see a parameter shared with
            another rank's layer: tie weights across stages only by a sum over their
            gradients of your own).
        dims: the mesh; pipeline rank ``dims.pp_rank`` holds stages ``pp_rank + c*pp``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zb-h1"``.
        micro_batches: ``m``; each step's batch is split into ``m`` along dim 0.
        virtual_stages: model chunks per rank (``interleaved-1f1b`` only).
        layers_per_stage: layer counts per stage (stage order), instead of an even split.
        grad_sync: data-parallel gradient reduction with ``no_sync()`` (context) and
            ``finish_grad_sync()``: every weight-gradient pass (B, or W in zb-h1) of the step
            but the rank's last runs under ``no_sync()``; ``finish_grad_sync()`` is called at
            the end of every training step (so buckets of other chunks, with interleaving,
            are reduced there). W accumulates with ``autograd.backward(params, grads)`` on the
            leaves, one layer at a time, so post-accumulate-grad hooks (DDP / ZeRO buckets)
            fire from W; see :mod:`distllm.ops.weight_grad` for how B and W split the work.
        track_memory: measure bytes saved for backward per micro-batch (small overhead).
        p2p_channels: one process group per direction between neighbouring stages (default:
            on NCCL, whose in-order streams need it; see ``pp_comm``), else one group.
        run_chunk: ``run_chunk(c, x)`` runs this rank's chunk ``c`` on ``x``, for a model whose
            forward does more than call its layers in turn (the GPT's batch-split overlap,
            :meth:`distllm.models.GPT.forward` over the chunk's layers); default: the layers
            of ``self.chunks[c]`` in order.

    ``self.chunks[c]`` is an ``nn.Sequential`` of global layers ``self.layer_ids[c]``.
    """

    def __init__(self, layers: LayerSpec, dims, schedule: str = "1f1b", micro_batches: int = 1,
                 virtual_stages: int = 1, layers_per_stage: Sequence[int] | None = None, *,
                 num_layers: int | None = None, grad_sync=None, track_memory: bool = False,
                 p2p_channels: bool | None = None,
                 run_chunk: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        if callable(layers) and not isinstance(layers, nn.Module | Sequence):
            if num_layers is None:
                raise ValueError("layers is a function: give num_layers as well")
            build, n = layers, num_layers
        else:
            layers = list(layers)
            build, n = layers.__getitem__, len(layers)
        self.dims, self.pp, self.pp_rank = dims, dims.pp, dims.pp_rank
        self.schedule: Schedule = build_schedule(schedule, dims.pp, micro_batches, virtual_stages)
        self.v = virtual_stages
        ranges = split_layers(n, dims.pp, virtual_stages, layers_per_stage)
        self.layer_ids = [list(ranges[c * self.pp + self.pp_rank]) for c in range(self.v)]
        if not callable(layers):
            _refuse_weights_across_ranks(layers, ranges, self.pp)
        self.chunks = nn.ModuleList(nn.Sequential(*map(build, ids)) for ids in self.layer_ids)
        self.grad_sync, self.track_memory = grad_sync, track_memory
        self.run_chunk = run_chunk or (lambda c, x: self.chunks[c](x))
        self.pp_ranks = dims.group_ranks("pp")
        if p2p_channels is None:
            p2p_channels = backend_for(dims.pp_group, dims.device.type) == "nccl"
        chans = p2p_channel_groups(dims, wrap=self.v > 1) if p2p_channels and self.pp > 1 else None
        self.comm = StageComm(dims.rank, dims.pp_group, dims.device, self.pp * self.v,
                              channels=chans)
        self.eval_comm = StageComm(dims.rank, dims.pp_group, dims.device, self.pp * self.v,
                                   every_header=True, channels=chans)
        self.last_stats = StepStats()
        if self.pp > 1:  # start the pipeline communicator on every rank together
            dist.all_reduce(torch.zeros(1, device=dims.device), group=dims.pp_group)

    def __setattr__(self, name: str, value) -> None:
        if name == "grad_sync":
            # a reference, not a child: a DDP / ZeRO wrapper is an nn.Module holding these
            # very chunks, and registered it would put every parameter in state_dict() twice
            self._modules.pop(name, None)
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def global_named_parameters(self):
        """``("layers.<global layer index>.<name>", param)`` for this rank's parameters: names
        that do not depend on pp / virtual_stages (for checkpoints and parity checks)."""
        for ids, chunk in zip(self.layer_ids, self.chunks, strict=True):
            for i, layer in zip(ids, chunk, strict=True):
                for name, p in layer.named_parameters():
                    yield f"layers.{i}.{name}", p

    @property
    def micro_batches(self) -> int:
        return self.schedule.micro_batches

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def train_step(self, batch: torch.Tensor | None, targets: torch.Tensor | None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """Forward and backward of one batch under the schedule; returns the loss.

        ``batch`` is read on the first stage, ``targets`` on the last (other ranks may pass
        ``None``); both are split into ``m`` micro-batches along dim 0. ``loss_fn(output,
        targets)`` must be a mean over the micro-batch; the loss returned on every rank of the
        pipeline is the mean over the ``m`` micro-batches, which is the one-process loss of
        the whole batch when every micro-batch counts the same number of tokens (no uneven
        ``ignore_index`` masking), and gradients accumulate into ``.grad`` scaled the same way
        (call ``zero_grad`` between steps). The loss is this data-parallel replica's; average
        it over ``dims.dp_group`` for logging if wanted. Collectives: P2P between stages, one
        broadcast of the loss over ``dims.pp_group``, plus whatever ``grad_sync`` does.
        Reading the loss is one host sync; :meth:`train_step_tensor` leaves it on the device.
        """
        return float(self.train_step_tensor(batch, targets, loss_fn))

    def train_step_tensor(self, batch: torch.Tensor | None, targets: torch.Tensor | None,
                          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          broadcast: bool = True) -> torch.Tensor:
        """:meth:`train_step` with the loss left on the device (a float64 scalar on
        ``dims.device``): no host sync, so a training loop reads it with its other metrics.
        ``broadcast=False``: no broadcast of the loss; it is the last stage's, 0 elsewhere
        (for a caller that reduces it with its other step metrics anyway, as ``Engine``)."""
        return self._step(self.schedule, batch, targets, loss_fn, train=True,
                          broadcast=broadcast)

    @torch.no_grad()
    def eval_step(self, batch: torch.Tensor | None, targets: torch.Tensor | None,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  micro_batches: int | None = None) -> float:
        """Forward-only loss of a batch (validation), same conventions as :meth:`train_step`;
        any batch shape and ``micro_batches`` (each activation carries its shape)."""
        if micro_batches is None:
            m, knob = self.micro_batches, "--micro-batches"
        elif isinstance(micro_batches, int) and not isinstance(micro_batches, bool) \
                and micro_batches >= 1:
            m, knob = micro_batches, "eval_step's micro_batches"
        else:
            raise ValueError(f"eval_step: micro_batches={micro_batches!r}: give a positive "
                             f"integer, or None for the training's {self.micro_batches}")
        sched = forward_only_schedule(self.pp, m, self.v)
        return float(self._step(sched, batch, targets, loss_fn, train=False, knob=knob))

    def _step(self, sched: Schedule, batch, targets, loss_fn, train: bool,
              broadcast: bool = True, knob: str = "--micro-batches") -> torch.Tensor:
        m = sched.micro_batches
        if self.is_first and batch is None or self.is_last and targets is None:
            raise ValueError("the first stage needs the batch and the last stage the targets")
        mbs = split_micro_batches(batch, m, "the batch", knob) if self.is_first else None
        tgts = split_micro_batches(targets, m, "the targets", knob) if self.is_last else None
        run = _StepRun(self, sched, mbs, tgts, loss_fn, train)
        loss = run.execute()  # (1,) float64 on the device; 0 off the last stage
        if train and self.grad_sync is not None:
            self.grad_sync.finish_grad_sync()
        if self.pp > 1 and broadcast:
            dist.broadcast(loss, src=self.pp_ranks[-1], group=self.dims.pp_group)
        return loss[0]


def _leaves_besides(y: torch.Tensor, known: set[int], x: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that ``y``'s graph accumulates a gradient into, but those whose
    ``id`` is in ``known`` and those behind the stage's input ``x`` (a micro-batch that is a
    view of a batch requiring grad: the batch gets its gradient through ``x``'s): one walk of
    the graph's nodes."""
    found, seen, todo = [], {x.grad_fn} - {None}, [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad's
        if leaf is not None:
            if id(leaf) not in known:
                known.add(id(leaf))
                found.append(leaf)
            continue
        todo.extend(n for n, _ in node.next_functions)
    return found


def _boundary_grad(x: torch.Tensor, dx: torch.Tensor | None) -> torch.Tensor:
    """What a stage sends back for its input ``x``: its gradient, or zeros where ``x`` got
    none (an integer activation, or one the stage does not read): the schedule has a
    message for every boundary, and a previous stage whose output takes no gradient skips
    its backward."""
    return dx if dx is not None else torch.zeros_like(x)


class _StepRun:
    """State of one step on one rank: stage inputs/outputs per (mb, chunk), losses, stats."""

    def __init__(self, pp: PipelineParallel, sched: Schedule, mbs, tgts, loss_fn, train: bool):
        self.pp, self.sched, self.mbs, self.tgts = pp, sched, mbs, tgts
        self.loss_fn, self.train = loss_fn, train
        self.rank, self.p, self.S = pp.pp_rank, pp.pp, sched.num_stages
        self.comm = pp.comm if train else pp.eval_comm
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.to_send: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.stats = StepStats()
        self.held, self.held_bytes = 0, 0
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self.wstores: dict[tuple[int, int], WeightGradStore] = {}
        self.outside: dict[int, list[torch.Tensor]] = {}  # per chunk: see _input_grad
        grad_kind = W if sched.split_backward else B
        self.last_grad = [a for a in sched.actions[self.rank] if a.kind == grad_kind][-1:]
        if pp.track_memory:
            self.param_ptrs = {q.untyped_storage().data_ptr() for q in pp.parameters()}

    def execute(self) -> torch.Tensor:
        """Run this rank's actions; the mean loss over the micro-batches, ``(1,)`` float64 on
        the device (zero off the last stage), not read back."""
        comm = self.comm
        self.stats.t_start = time.perf_counter()
        for a in self.sched.actions[self.rank]:
            if a.kind in (SEND_F, SEND_B, RECV_F, RECV_B):
                self._post(a)
                continue
            comm.flush()
            {F: self._forward, B: self._backward, W: self._weight}[a.kind](a)
        t0 = time.perf_counter()
        comm.finish()
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.t_end = time.perf_counter()
        self.pp.last_stats = self.stats
        if not self.losses:
            return torch.zeros(1, dtype=torch.float64, device=self.pp.dims.device)
        return (torch.stack(self.losses).sum() / self.sched.micro_batches).reshape(1)

    def _peer(self, a: Action) -> tuple[tuple, int]:
        key, peer_pp_rank = message_of(a, self.rank, self.p)
        return key, self.pp.pp_ranks[peer_pp_rank]

    def _post(self, a: Action) -> None:
        key, peer = self._peer(a)
        if a.kind == RECV_F or a.kind == RECV_B:
            self.comm.recv(key, peer)
        else:
            self.comm.send(key, self.to_send.pop((a.mb, a.chunk)), peer)

    def _wait(self, recv: Action) -> torch.Tensor:
        t0 = time.perf_counter()
        key, peer = self._peer(recv)
        out = self.comm.wait(key, peer)
        self.stats.wait_s += time.perf_counter() - t0
        return out

    def _input(self, a: Action) -> torch.Tensor:
        s = self.sched.stage(self.rank, a.chunk)
        if s == 0:
            return self.mbs[a.mb]
        x = self._wait(Action(RECV_F, a.mb, a.chunk))
        if self.train and x.is_floating_point():
            x.requires_grad_(True)
        return x

    def _forward(self, a: Action) -> None:
        x = self._input(a)
        t0 = time.perf_counter()
        s, mbc = self.sched.stage(self.rank, a.chunk), (a.mb, a.chunk)
        defer = contextlib.nullcontext()
        if self.train and self.sched.split_backward:
            self.wstores[mbc] = WeightGradStore()
            defer = DeferLinearWeightGrads(self.wstores[mbc])
        with self._saved_hooks(mbc):  # the loss too: its log-softmax is the last stage's largest
            with defer:
                y = self.pp.run_chunk(a.chunk, x)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"stage {s} returned {type(y).__name__}: each pipeline stage "
                                "must return one tensor (wrap layers that return tuples)")
            if s == self.S - 1:
                loss = self.loss_fn(y, self.tgts[a.mb])
        if s == self.S - 1:
            self.losses.append(loss.detach().double())
            y = loss / self.sched.micro_batches
        else:
            self.to_send[mbc] = y.detach()
            self.comm.shapes[("B", s)] = (y.shape, y.dtype)
        if self.train:
            self.inputs[mbc], self.outputs[mbc] = x, y
            self.held += 1
            self.held_bytes += self.saved_bytes.get(mbc, 0)
            st = self.stats
            st.peak_activations = max(st.peak_activations, self.held / self.sched.virtual_stages)
            st.peak_activation_bytes = max(st.peak_activation_bytes, self.held_bytes)
        self.stats.timeline.append((a, t0, time.perf_counter()))

    def _grad_ctx(self, a: Action):
        gs = self.pp.grad_sync
        if gs is None or a in self.last_grad:
            return contextlib.nullcontext()
        return gs.no_sync()

    def _backward(self, a: Action) -> None:
        s, mbc = self.sched.stage(self.rank, a.chunk), (a.mb, a.chunk)
        grad = None
        if s < self.S - 1:
            grad = self._wait(Action(RECV_B, a.mb, a.chunk))
        t0 = time.perf_counter()
        x, y = self.inputs[mbc], self.outputs[mbc]
        if self.sched.split_backward:  # input gradient now, weight gradients left for W
            dx = self._input_grad(a, x, y, grad, self.wstores[mbc])
            if s > 0:
                self.to_send[mbc] = _boundary_grad(x, dx)
            elif dx is not None:  # a batch that requires grad gets it, as on one process
                torch.autograd.backward(x, dx)
            del self.outputs[mbc]
        else:
            if y.requires_grad:  # (not: a frozen stage, an integer output)
                with self._grad_ctx(a):
                    torch.autograd.backward(y, grad)
            if s > 0:
                self.to_send[mbc] = _boundary_grad(x, x.grad if x.requires_grad else None)
            self._free(mbc)
        self.stats.timeline.append((a, t0, time.perf_counter()))

    def _input_grad(self, a: Action, x, y, grad, store: WeightGradStore):
        """B of a split backward: one autograd pass for dX and the gradients of the parameters
        whose weight gradient is not deferred (norms, embeddings, the biases whose gradient
        needs a collective or that a fused kernel computed), accumulated at once, as W would
        (hooks fire under W's gradient-sync context), so that no copy of them waits for W;
        a parameter with a deferred part too leaves this part to W, which sums them. The
        deferred weight GEMMs record what they need in ``store``. Other leaves of the graph
        that require grad (a tensor ``loss_fn`` or a layer reads that is not a parameter of
        the stage) get theirs here too, as a plain backward gives them. Frees the graph."""
        if not y.requires_grad:  # nothing of the stage's takes a gradient (frozen, integer)
            return None
        params = [q for q in self.pp.chunks[a.chunk].parameters() if q.requires_grad]
        want_x = x.requires_grad
        if a.chunk not in self.outside:  # found once a step: the graph's other leaves
            self.outside[a.chunk] = _leaves_besides(y, {id(x)} | {id(q) for q in params}, x)
        others = self.outside[a.chunk]
        inputs = ([x] if want_x else []) + params + others
        if not inputs:
            return None
        try:
            grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
        except RuntimeError as e:  # CheckpointError is one; reentrant checkpoint raises another
            if "checkpoint" not in f"{type(e).__name__} {e}".lower():
                raise
            raise ValueError(
                f"schedule={self.sched.name!r} splits each backward into B and W, which "
                f"activation checkpointing inside a stage (torch.utils.checkpoint) does not "
                f"allow: use another schedule (e.g. '1f1b'), or run the stage's layers "
                f"without checkpointing") from e
        grads_of_others = grads[len(inputs) - len(others):]
        done = [(q, gq) for q, gq in zip(params, grads[int(want_x):len(inputs) - len(others)],
                                         strict=True) if gq is not None]
        if any(g is not None for g in grads_of_others):
            torch.autograd.backward([t for t, g in zip(others, grads_of_others, strict=True)
                                     if g is not None],
                                    [g for g in grads_of_others if g is not None])
        waits = store.deferred_params()  # its other part is W's: W sums them, hooks once
        store.params += [q for q, _ in done if id(q) in waits]
        store.grads += [gq for q, gq in done if id(q) in waits]
        done = [(q, gq) for q, gq in done if id(q) not in waits]
        if done:
            with self._grad_ctx(Action(W, a.mb, a.chunk)):
                torch.autograd.backward([q for q, _ in done], [gq for _, gq in done])
        return grads[0] if want_x else None

    def _weight(self, a: Action) -> None:
        mbc = (a.mb, a.chunk)
        t0 = time.perf_counter()
        with self._grad_ctx(a):  # AccumulateGrad on the leaves: post-accumulate hooks fire
            self.wstores.pop(mbc).accumulate()
        self._free(mbc)
        self.stats.timeline.append((a, t0, time.perf_counter()))

    def _free(self, mbc: tuple[int, int]) -> None:
        self.inputs.pop(mbc)
        self.outputs.pop(mbc, None)
        self.held -= 1
        self.held_bytes -= self.saved_bytes.pop(mbc, 0)

    def _saved_hooks(self, mbc: tuple[int, int]):
        if not (self.pp.track_memory and self.train):
            return contextlib.nullcontext()
        seen: set[tuple[int, tuple]] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.param_ptrs and (ptr, tuple(t.shape)) not in seen:
                seen.add((ptr, tuple(t.shape)))
                self.saved_bytes[mbc] = self.saved_bytes.get(mbc, 0) + t.numel() * t.element_size()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
