"""A dry run of the real training code for one rank of a layout this machine cannot run.

The trainer's own engine (:class:`distllm.train.engine.Engine`: the GPT chunks of this rank,
the pipeline executor, DDP or ZeRO, AdamW) is built and run for one training step on fake
tensors: ``FakeTensorMode`` gives every tensor a shape, a dtype and a device but no memory
and no arithmetic, and the ``fake`` process-group backend answers every collective at once.
A dispatch mode counts the bytes of every storage alive (each storage once, freed when the
last tensor on it dies, resized when ``UntypedStorage.resize_`` says so) and keeps the peak.
An optimizer update before the first gradient creates the optimizer states and gradient
shards first (torch's AdamW, which creates a parameter's states at its first gradient, is
given zero gradients for it), so the measured step is a steady-state one (its peaks equal a
second step's).

What a dry run cannot know it is told: a value read back from a fake tensor (a loss, a
norm, an inf/NaN flag) reads as zero; the shape header a pipeline stage receives is the
activation shape its sender sends; a collective has completed as soon as it is issued (the
fake backend's ``wait`` returns at once; its ``is_completed`` is made to agree, so gradient
buckets are freed as on a GPU once their reduction is done); a fake tensor's ``data_ptr`` is
made unique per storage (the gradient buckets compare pointers); ``Module.to`` of a module
already on the device is left alone (torch would swap each fake parameter, which fails).
The fake tensors live on the CPU; where the code takes another path on the device the run
stands for (``device``), it takes that one: on CUDA, :mod:`distllm.nn.precision`'s layer norm
and embedding run on 16-bit tensors as they are (on the CPU they compute in fp32, and a
layer norm keeps an fp32 copy of its input for backward).
Scalars and small integer or boolean tensors made by factory calls run for real, so step
counts, masks and index arithmetic keep their values; their bytes are counted as well.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["DryRun", "dry_run", "SMALL_REAL", "DEVICES"]

SMALL_REAL = 1 << 17  # integer/boolean factory results below this many elements are real
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def _keeps_values(t: torch.Tensor) -> bool:
    """A factory result made for real: a scalar (an optimizer's step count), or a small
    integer or boolean tensor (a mask, an index range, a pipeline shape header). Floating
    tensors of more than one element (weights, buffers, activations) stay fake."""
    return t.numel() <= 1 or (not t.dtype.is_floating_point and t.numel() < SMALL_REAL)


class _Counter(TorchDispatchMode):
    """Live and peak bytes of every storage an op returns; fake reads answered with 0."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.ops = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def track(self, t: torch.Tensor) -> None:
        if t.is_meta:  # no memory, where it runs for real either (ZeRO-3's model before it
            return  # materialises each layer)
        st = t.untyped_storage()
        if st in self._seen:
            return
        box = [st.nbytes()]  # the storage's current size, updated on resize_
        self._seen[st] = box
        self._add(box[0])
        weakref.finalize(st, self._free, box)

    def resized(self, st: torch.UntypedStorage) -> None:
        """A tracked storage changed size in place (ZeRO-3 frees and re-gathers this way)."""
        box = self._seen.get(st)
        if box is not None:
            n, box[0] = box[0], st.nbytes()
            self._add(box[0] - n)

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def _free(self, box: list[int]) -> None:
        self.live -= box[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        leaves = tree_leaves((args, kwargs))
        if func is _LOCAL_SCALAR and isinstance(args[0], FakeTensor):
            dt = args[0].dtype
            return False if dt == torch.bool else (0.0 if dt.is_floating_point else 0)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if tensors and not any(isinstance(x, FakeTensor) for x in tensors):
            with unset_fake_temporarily():  # real inputs only: a real op
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if not tensors and isinstance(out, torch.Tensor) and _keeps_values(out):
                with unset_fake_temporarily():  # a scalar, mask or index: keep its values
                    out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


DEVICES = ("cuda", "cpu")


@contextlib.contextmanager
def _patched(header: tuple[torch.Size, torch.dtype], counter: _Counter,
             device: str = "cpu") -> Iterator[None]:
    """The stand-ins listed in the module docstring, and the counting of in-place storage
    resizes (which no op reports), undone on exit."""
    from distllm.nn import precision
    from distllm.parallel.pipeline import pp_comm

    bases: WeakIdKeyDictionary = WeakIdKeyDictionary()
    # a new base for every storage: numbering by the number of live storages would give a
    # new one the base of a live one once any died, and the gradient buckets would take a
    # parameter's own gradient for its bucket slice (and keep it: 246 MB at gpt2-xl dp8)
    fresh = itertools.count(1)

    def data_ptr(t: torch.Tensor) -> int:
        st = t.untyped_storage()
        if st not in bases:
            bases[st] = next(fresh) << 40
        return bases[st] + t.storage_offset() * t.element_size()

    orig_to, orig_decode = torch.nn.Module.to, pp_comm._decode
    orig_low = precision._low_on_cpu

    def to(self, *args, **kwargs):
        dev, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if dtype is None and all(dev is None or t.device == dev for t in tensors):
            return self
        return orig_to(self, *args, **kwargs)

    work = torch._C._distributed_c10d.FakeWork
    orig_done, orig_resize = work.is_completed, torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int):
        out = orig_resize(st, size)
        counter.resized(st)
        return out

    torch.UntypedStorage.resize_ = resize_
    FakeTensor.data_ptr = data_ptr
    torch.nn.Module.to = to
    pp_comm._decode = lambda _hdr: header
    work.is_completed = lambda _self: True  # as its wait(): done at once
    if device != "cpu":
        precision._low_on_cpu = lambda _t: False
    try:
        with warnings.catch_warnings():
            # a fake storage's data_ptr (ZeRO's clipping tells its buckets' storages apart by
            # it): torch warns that it is not a real address, which a dry run knows
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        precision._low_on_cpu = orig_low
        del FakeTensor.data_ptr
        torch.nn.Module.to = orig_to
        pp_comm._decode = orig_decode
        work.is_completed = orig_done
        torch.UntypedStorage.resize_ = orig_resize


@dataclass
class DryRun:
    """One rank's memory in a dry run (bytes)."""

    layout: str
    world: int
    rank: int
    pp_rank: int
    peak: int
    """Most bytes alive at once in the measured step."""
    peak_phase: str
    """``forward-backward`` or ``optimizer``: where that peak was."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak of each phase of the measured step."""
    states: dict[str, int] = field(default_factory=dict)
    """params, grads, optimizer: the bytes the engine holds after the step."""
    seconds: float = 0.0
    ops: int = 0


def _state_bytes(engine) -> dict[str, int]:
    """Bytes of parameters, gradient buffers and optimizer states, each storage once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in seen:
                seen.add(id(t.untyped_storage()))
                n += t.untyped_storage().nbytes()
        return n

    z = engine.zero
    params = [p for c in engine.chunks for p in c.parameters()]
    out = {"params": size(params)}
    if z is not None:
        if z.sharded is not None:
            out["params"] += size(f.shard for fl in z.sharded.flats.values() for f in fl)
        out["params"] += size(f for f in z.flat if f is not None)
        bufs = [b.buffer for b in z.reducer.buckets] + [b.shard for b in z.reducer.buckets]
        out["grads"] = size(bufs + [p.grad for p in params] + [m.grad for m in z.masters])
        state = [v for s in z.optimizer.state.values() for v in s.values()]
        out["optimizer"] = size(list(z.masters) + state)
    else:
        reducer = getattr(engine.ddp, "reducer", None)  # none with a single DP rank
        bufs = [b.buffer for b in reducer.buckets] if reducer is not None else []
        out["grads"] = size(bufs + [p.grad for p in params])
        out["optimizer"] = size(v for s in engine.optimizer.state.values() for v in s.values())
    return out


def _measure(engine, counter: _Counter, tokens: torch.Tensor, clip: float):
    """(peak bytes of each phase, state bytes) of one steady-state step of ``engine``."""
    # an update before any gradient creates the optimizer states and the gradient shards,
    # so that the step measured next is a steady-state one; torch's AdamW (stage 0 without
    # master weights) creates a parameter's states at its first gradient, so each parameter
    # without one gets zeros for that update (which then frees them, as a real step does)
    if engine.zero is None:
        for p in (p for c in engine.chunks for p in c.parameters()):
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    engine.update(clip)
    phases: dict[str, int] = {}
    counter.peak = counter.live
    loss = engine.forward_backward(tokens, tokens)
    phases["forward-backward"] = counter.peak
    counter.peak = counter.live
    engine.update(clip, loss)
    phases["optimizer"] = counter.peak
    return phases, _state_bytes(engine)


def dry_run(train_cfg, model_cfg, world: int, pp_rank: int = 0, device: str = "cuda") -> DryRun:
    """One training step of global rank ``pp_rank * dp * tp`` (pipeline rank ``pp_rank``,
    first DP and TP rank) of ``train_cfg``'s layout on ``world`` fake ranks, taking the code
    paths of ``device`` (``cuda`` or ``cpu``, see the module docstring).

    ``train_cfg``: a :class:`distllm.train.config.TrainConfig` (its ``parallel`` layout,
    ``dtype``, ``global_batch``, ``seq_len`` and ``activation_checkpointing``);
    ``model_cfg``: the :class:`distllm.models.gpt.GPTConfig` to build.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distllm.parallel.mesh import ParallelDims
    from distllm.train.config import check_layout
    from distllm.train.engine import DTYPE, Engine

    p = train_cfg.parallel
    seq = train_cfg.seq_len or model_cfg.max_seq_len
    dp = check_layout(train_cfg, world, n_layers=model_cfg.n_layers, n_heads=model_cfg.n_heads,
                      hidden=model_cfg.hidden_size, seq_len=seq)
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: choose one of {', '.join(DEVICES)}")
    if not 0 <= pp_rank < p.pp:
        raise ValueError(f"pp_rank={pp_rank}: choose a pipeline rank in 0..{p.pp - 1}")
    if dist.is_initialized():
        raise RuntimeError("a dry run starts its own fake process group: call it outside an "
                           "initialised torch.distributed job")
    rank = pp_rank * dp * p.tp
    b = train_cfg.global_batch // (dp * p.micro_batches)
    sp = p.sequence_parallel and p.tp > 1
    header = (torch.Size([b, seq // p.tp if sp else seq, model_cfg.hidden_size]),
              DTYPE[train_cfg.dtype])
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    counter = _Counter()
    try:
        with _patched(header, counter, device), FakeTensorMode(allow_non_fake_inputs=True), counter:
            engine = Engine(train_cfg, model_cfg, ParallelDims(tp=p.tp, pp=p.pp, dp=dp))
            tokens = torch.zeros(train_cfg.global_batch // dp, seq, dtype=torch.long)
            phases, states = _measure(engine, counter, tokens, train_cfg.optim.grad_clip)
            del engine
    finally:
        dist.destroy_process_group()
    where = max(phases, key=phases.get)
    return DryRun(p.layout(), world, rank, pp_rank, phases[where], where, phases, states,
                  time.perf_counter() - t0, counter.ops)
