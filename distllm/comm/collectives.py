"""Collectives every parallelism shares, written once.

- :func:`reduce_scatter`: sum-reduce-scatter of one flat tensor, the one every parallelism
  calls (the DP gradient buckets, the TP overlap engines and mappings). On gloo with CPU
  tensors it is :func:`reduce_scatter_pairwise`: gloo's own reduce-scatter moves as many
  bytes as its all-reduce, the pairwise exchange the minimum (each rank sends
  ``(world-1)/world`` of its input once). Gloo with CUDA tensors takes
  :func:`reduce_scatter_by_all_reduce` (gloo's point-to-point takes CPU tensors); other
  backends (NCCL) run the collective, through
  :func:`distllm.comm.compat.reduce_scatter_into`.
- :func:`reduce_scatter_pairwise`: rank ``r`` sends slice ``q`` of its input straight to
  rank ``q`` and sums the slices ``r`` it receives (``isend`` / ``irecv`` that gloo's
  transport threads progress); ``inp`` is only read.
- :func:`reduce_scatter_by_all_reduce`: the all-reduce of the whole input, of which each
  rank keeps its slice, on any backend (``inp`` is overwritten with the full sum).
- :func:`all_gather`: the all-gather of one flat tensor into ``world`` slices, the one the
  ZeRO parameter gathers call. On gloo with CPU tensors of at least
  :data:`PAIRWISE_MIN_BYTES` per rank it is :func:`all_gather_pairwise`; below that, and on
  other backends, the backend's collective (:func:`distllm.comm.compat.all_gather_into`).
  Gloo's all-gather is a ring: ``world - 1`` rounds, each a send and a receive through the
  transport thread; the pairwise exchange posts every message at once. On 2 CPU ranks over
  loopback (interleaved medians, one process's CPU per call) it took 2.6 ms of CPU against
  3.3 ms for the gathers of three buckets of 1.2, 0.1 and 2.2 MB, and 10.0 against 12.5 ms
  for one of 26 MB; at 40 KB per rank gloo's was faster. Between 2 ranks gloo's ring is one
  round too: one blocking gather of 256 B to 256 KB a rank was no faster pairwise (1.1-1.6
  ms of wall time either way, on a slower machine than the figures above).
- :func:`all_gather_pairwise`: rank ``r`` sends its input to every peer and receives each
  peer's into its slice of ``out`` (``isend`` / ``irecv``); its own slice is copied (or
  already in place when ``inp`` is that slice of ``out``).
- :func:`all_reduce`: the sum (or max) all-reduce in place of one contiguous tensor, the
  one every parallelism calls (DDP's buckets, the TP layers and overlap engines, the
  vocabulary-parallel cross-entropy, the global gradient norm, the step's metrics). On
  gloo with CPU tensors over exactly 2 ranks it is :func:`all_reduce_exchange`; otherwise
  the backend's collective. Between 2 ranks gloo's ring sends half the tensor, then the
  other half, one round after the other; the exchange sends the whole tensor at once (the
  same bytes) and each rank combines what it received. On 2 CPU ranks over loopback
  (interleaved medians of 25 rounds of 10 calls, one process's CPU) it took 0.60 against
  1.13 ms of wall time (0.26 against 0.61 ms of CPU) for 3 float64 values, 0.68 against
  1.59 ms for 16384, and 1.15 against 1.82 ms for 131072 float32; so, unlike the
  all-gather's, it has no size floor (:data:`EXCHANGE_MIN_BYTES`). Over an emulated
  2 Gbit/s link a training step was level with the ring, and the row-parallel layer up to
  5% slower at 16 MB (the README's overlap section). Its cost is memory: each
  exchange in flight holds a receive buffer the size of its tensor, so DDP's buckets, in
  flight together at the end of backward, hold up to one more copy of the gradients until
  they are waited on, and so do the TP overlap engine's chunks.
- :func:`all_reduce_exchange`: the 2-rank all-reduce as one exchange: each rank sends its
  tensor and adds the peer's into it, or keeps the larger (both taken in rank order, rank
  0's operand first: the same bits on both ranks).
- :func:`broadcast_from`: a broadcast whose source is named by its rank *within* the group
  (torch's ``src`` is a global rank).

Each returns, with ``async_op=True``, a handle with ``wait()`` and ``is_completed()``; the
reduce-scatters and all-gathers write ``out`` by the time ``wait()`` returns. Their arguments
are checked before any message is posted (a ``ValueError`` naming what to change): a call that
raises leaves no message in flight. ``out`` and ``inp`` must share dtype and device (nothing is
converted); the reduce-scatters and :func:`all_gather_pairwise` take contiguous tensors.
Tensors that require grad are written as ``torch.distributed``'s collectives write them,
outside autograd. Gloo (seen on torch 2.14.1) reports its point-to-point messages completed
only once they are waited on, so the point-to-point handles' ``is_completed()`` stays False
until their ``wait()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from distllm.comm.compat import all_gather_into, reduce_scatter_into

__all__ = ["reduce_scatter", "reduce_scatter_pairwise", "reduce_scatter_by_all_reduce",
           "all_gather", "all_gather_pairwise", "all_reduce", "all_reduce_exchange",
           "broadcast_from", "backend_for", "group_device", "PAIRWISE_MIN_BYTES",
           "EXCHANGE_MIN_BYTES"]

def backend_for(group: ProcessGroup | None, device_type: str) -> str | None:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors ("gloo",
    "nccl", ...), or None where none does. Read from torch's backend configuration
    (``"cpu:gloo,cuda:nccl"``), so that a group made by ``init_process_group()`` without a
    backend, or with one per device, answers as a plain ``"nccl"`` group does (for those,
    ``get_backend`` says ``"undefined"`` or the whole string)."""
    table = dict(part.split(":", 1)
                 for part in dist.get_backend_config(group).split(",") if ":" in part)
    return table.get(device_type)


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """The device of the tensors ``group``'s collectives take: the current CUDA device
    where NCCL serves CUDA tensors, else the CPU."""
    if backend_for(group, "cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# gloo, CPU tensors: the all-gather is pairwise from this many bytes per rank (see above)
PAIRWISE_MIN_BYTES = 64 * 1024
# gloo, CPU tensors, 2 ranks: the all-reduce is the exchange from this many bytes (read at
# each call: a benchmark may raise it to run gloo's own ring instead)
EXCHANGE_MIN_BYTES = 0


class _SliceOnWait:
    """The all-reduce of ``inp`` in flight; this rank's slice lands in ``out`` before the
    handle reports completion (:meth:`wait`, :meth:`is_completed`, :meth:`get_future`)."""

    def __init__(self, work: Work, out: torch.Tensor, inp: torch.Tensor, lo: int) -> None:
        self.work, self.out, self.inp, self.lo = work, out, inp, lo
        self.done = False

    def _copy(self) -> None:
        # (idempotent: a future's callback and the caller may both get here)
        if not self.done:
            n = self.out.numel()
            with torch.no_grad():
                self.out.view(-1).copy_(self.inp.view(-1)[self.lo: self.lo + n])
            self.done = True

    def is_completed(self) -> bool:
        if not self.done and self.work.is_completed():
            # waited all the same (it returns at once): on NCCL torch keeps the collective's
            # tensors, the whole bucket here, until a wait or its watchdog's next look
            self.work.wait()
            self._copy()
        return self.done

    def get_future(self) -> torch.futures.Future:
        def sliced(_fut: torch.futures.Future) -> list[torch.Tensor]:
            self._copy()
            return [self.out]
        return self.work.get_future().then(sliced)

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            self._copy()
        return True


class _InFlight:
    """Point-to-point messages in flight: :meth:`wait` waits for ``works``, then runs the
    subclass's :meth:`_finish_local` (what this rank computes from what it received) once."""

    def __init__(self) -> None:
        self.works: list[Work] = []
        self.done = False

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        if not self.done:
            for w in self.works:
                w.wait()
            with torch.no_grad():  # ``out`` / ``t`` may require grad, as in torch's collectives
                self._finish_local()
            self.works, self.done = [], True
        return True

    def _finish_local(self) -> None:
        pass


class _PairwiseOnWait(_InFlight):
    """The pairwise exchange in flight; :meth:`wait` sums this rank's slices into ``out``."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None):
        super().__init__()
        world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.out, self.parts = out, inp.view(world, -1)  # (world, n): slice q goes to rank q
        self.bufs: list[torch.Tensor] = []
        for q in range(world):
            if q == self.rank:
                continue
            buf = torch.empty_like(self.parts[q])
            self.bufs.append(buf)
            self.works.append(dist.irecv(buf, group=group, group_src=q))
            self.works.append(dist.isend(self.parts[q], group=group, group_dst=q))

    def _finish_local(self) -> None:
        acc = self.out.view(-1)
        # own slice + peers in rank order: the same summation order every run; the first
        # sum written straight into ``out`` (no copy of the own slice first)
        if self.bufs:
            torch.add(self.parts[self.rank], self.bufs[0], out=acc)
        else:
            acc.copy_(self.parts[self.rank])
        for buf in self.bufs[1:]:
            acc.add_(buf)
        self.bufs = []


class _GatherPairwise(_InFlight):
    """The pairwise all-gather in flight: every message is posted; :meth:`wait` waits."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None):
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slots = out.view(world, -1)  # slot q receives rank q's input
        peers = [q for q in range(world) if q != rank]
        self.works += [dist.irecv(slots[q], group=group, group_src=q) for q in peers]
        self.works += [dist.isend(inp.view(-1), group=group, group_dst=q) for q in peers]
        if slots[rank].data_ptr() != inp.data_ptr():  # (in place: already there)
            with torch.no_grad():
                slots[rank].copy_(inp.view(-1))


def _check_like(what: str, out: torch.Tensor, inp: torch.Tensor, contiguous: bool) -> None:
    """Raise before any message is posted when ``out`` and ``inp`` differ in dtype or device
    (``out`` receives ``inp``'s bytes as they are) or, with ``contiguous``, when either is not
    contiguous (each message is a tensor's flat memory)."""
    if out.dtype != inp.dtype:
        raise ValueError(f"{what}: out is {out.dtype}, inp {inp.dtype}; allocate out with "
                         f"dtype={inp.dtype} (nothing is converted)")
    if out.device != inp.device:
        raise ValueError(f"{what}: out is on {out.device}, inp on {inp.device}; allocate out "
                         f"on {inp.device}")
    if contiguous and not inp.is_contiguous():
        raise ValueError(f"{what}: inp is not contiguous; pass inp.contiguous()")
    if contiguous and not out.is_contiguous():
        raise ValueError(f"{what}: out is not contiguous; pass a contiguous out (torch.empty) "
                         f"and copy it where it belongs after")


def _check_sizes(out: torch.Tensor, inp: torch.Tensor, world: int) -> None:
    if inp.numel() != world * out.numel():
        raise ValueError(f"reduce-scatter over {world} ranks: inp has {inp.numel()} elements, "
                         f"out {out.numel()}; inp must hold {world} * out.numel() (pad it)")
    _check_like("reduce-scatter", out, inp, contiguous=True)


_EXCHANGE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX)


class _ExchangeAdd(_InFlight):
    """The 2-rank exchange in flight; :meth:`wait` adds (or takes the maximum of) the peer's
    tensor into ``t``."""

    def __init__(self, t: torch.Tensor, group: ProcessGroup | None,
                 op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        super().__init__()
        self.t, self.peer_t, self.is_max = t, torch.empty_like(t), op == dist.ReduceOp.MAX
        self.rank = dist.get_rank(group)
        peer = 1 - self.rank
        self.works = [dist.irecv(self.peer_t, group=group, group_src=peer),
                      dist.isend(t, group=group, group_dst=peer)]

    def _finish_local(self) -> None:
        # the same bits on both ranks: both compute op(rank 0's, rank 1's). The order matters
        # where the operands' bits do: maximum(-0, +0) is its first argument, and the sum of
        # two NaNs is the NaN (sign, payload) of one operand position, as the kernel computes
        # it; a NaN on either side gives NaN
        first, second = (self.t, self.peer_t) if self.rank == 0 else (self.peer_t, self.t)
        if self.is_max:
            torch.maximum(first, second, out=self.t)
        else:
            torch.add(first, second, out=self.t)
        self.peer_t = None


def _p2p_pays(group: ProcessGroup | None, *tensors: torch.Tensor,
              min_bytes: int = PAIRWISE_MIN_BYTES) -> bool:
    """Whether the point-to-point substitutes run: gloo, contiguous CPU tensors, the first
    (what each rank sends) of at least ``min_bytes``."""
    t = tensors[0]
    return (not t.is_cuda and backend_for(group, t.device.type) == "gloo"
            and all(x.is_contiguous() for x in tensors)
            and t.numel() * t.element_size() >= min_bytes)


def _check_gather_sizes(out: torch.Tensor, inp: torch.Tensor, world: int,
                        contiguous: bool = False) -> None:
    if out.numel() != world * inp.numel():
        raise ValueError(f"all-gather over {world} ranks: out has {out.numel()} elements, inp "
                         f"{inp.numel()}; out must hold {world} * inp.numel()")
    _check_like("all-gather", out, inp, contiguous)


def _finish(handle: _SliceOnWait | _InFlight, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_by_all_reduce(out: torch.Tensor, inp: torch.Tensor,
                                 group: ProcessGroup | None = None,
                                 async_op: bool = False) -> _SliceOnWait | None:
    """Sum ``inp`` over ``group`` with an all-reduce and copy slice ``r`` (of ``world``
    equal slices of the flattened input) into ``out`` on rank ``r``: the result of a
    reduce-scatter. ``inp`` (contiguous) is overwritten with the full sum. Returns a handle
    when ``async_op`` (``out`` is written by its ``wait()``), else ``None``."""
    world = dist.get_world_size(group)
    _check_sizes(out, inp, world)
    lo = dist.get_rank(group) * out.numel()
    work = dist.all_reduce(inp, group=group, async_op=True)
    return _finish(_SliceOnWait(work, out, inp, lo), async_op)


def reduce_scatter_pairwise(out: torch.Tensor, inp: torch.Tensor,
                            group: ProcessGroup | None = None,
                            async_op: bool = False) -> _PairwiseOnWait | None:
    """Reduce-scatter by point-to-point messages: rank ``r`` sends slice ``q`` of ``inp``
    (contiguous, ``world * out.numel()`` elements) to rank ``q`` and writes into ``out`` its
    own slice ``r`` plus the slices ``r`` of its peers, summed in rank order. ``inp`` is
    read, not written; it must stay unchanged until the handle is waited on. Returns the
    handle when ``async_op`` (``out`` is written by its ``wait()``), else ``None``."""
    _check_sizes(out, inp, dist.get_world_size(group))
    return _finish(_PairwiseOnWait(out, inp, group), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | _SliceOnWait | _PairwiseOnWait | None:
    """Sum-reduce-scatter ``inp`` (``world * out.numel()`` elements, contiguous) over
    ``group``: rank ``r`` receives slice ``r`` in ``out``. On gloo
    :func:`reduce_scatter_pairwise` for CPU tensors and :func:`reduce_scatter_by_all_reduce`
    (which overwrites ``inp``) for CUDA ones; elsewhere the backend's collective. Returns
    the handle when ``async_op``, else ``None``."""
    if backend_for(group, inp.device.type) == "gloo":
        if inp.is_cuda:
            return reduce_scatter_by_all_reduce(out, inp, group, async_op)
        return reduce_scatter_pairwise(out, inp, group, async_op)
    _check_sizes(out, inp, dist.get_world_size(group))
    return reduce_scatter_into(out, inp, group=group, async_op=async_op)


def all_gather_pairwise(out: torch.Tensor, inp: torch.Tensor,
                        group: ProcessGroup | None = None,
                        async_op: bool = False) -> _GatherPairwise | None:
    """All-gather by point-to-point messages: ``out`` (contiguous, ``world * inp.numel()``
    elements) receives every rank's ``inp`` in rank order. ``inp`` may be this rank's slice
    of ``out`` itself; it must stay unchanged until the handle is waited on. Returns the
    handle when ``async_op``, else ``None``."""
    _check_gather_sizes(out, inp, dist.get_world_size(group), contiguous=True)
    return _finish(_GatherPairwise(out, inp, group), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | _GatherPairwise | None:
    """All-gather ``inp`` from every rank of ``group`` into ``out`` (``world * inp.numel()``
    elements, contiguous), in rank order: :func:`all_gather_pairwise` on gloo for CPU
    tensors of at least :data:`PAIRWISE_MIN_BYTES`, else the backend's collective. Returns
    the handle when ``async_op``, else ``None``."""
    world = dist.get_world_size(group)
    _check_gather_sizes(out, inp, world)
    if not out.is_contiguous():
        raise ValueError("all-gather: out is not contiguous; pass a contiguous out "
                         "(torch.empty) and copy it where it belongs after")
    if world > 1 and _p2p_pays(group, inp, out):
        return _finish(_GatherPairwise(out, inp, group), async_op)
    # flat on both sides: the backend asks for out shaped as inp stacked or concatenated,
    # this function only for world * inp.numel() elements
    return all_gather_into(out.view(-1), inp.reshape(-1), group=group, async_op=async_op)


def all_reduce_exchange(t: torch.Tensor, group: ProcessGroup | None = None,
                        async_op: bool = False,
                        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> _ExchangeAdd | None:
    """All-reduce ``t`` (contiguous) in place over a group of exactly 2 ranks by one
    exchange: each sends ``t`` and adds what it receives (``op`` SUM) or keeps the larger
    (MAX). ``t`` must stay unchanged until the handle is waited on. Returns the handle when
    ``async_op``, else ``None``."""
    world = dist.get_world_size(group)
    if world != 2:
        raise ValueError(f"all_reduce_exchange runs over 2 ranks, this group has {world}")
    if not t.is_contiguous():
        raise ValueError("all_reduce_exchange needs a contiguous tensor")
    if op not in _EXCHANGE_OPS:
        raise ValueError(f"all_reduce_exchange reduces with SUM or MAX, not {op}")
    return _finish(_ExchangeAdd(t, group, op), async_op)


def all_reduce(t: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Work | _ExchangeAdd | None:
    """All-reduce ``t`` in place over ``group`` with ``op``: :func:`all_reduce_exchange` on
    gloo for contiguous CPU tensors of at least :data:`EXCHANGE_MIN_BYTES` over 2 ranks
    (SUM or MAX), else the backend's collective. Returns the handle when ``async_op``, else
    ``None``."""
    if (dist.get_world_size(group) == 2 and op in _EXCHANGE_OPS
            and _p2p_pays(group, t, min_bytes=EXCHANGE_MIN_BYTES)):
        return _finish(_ExchangeAdd(t, group, op), async_op)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def broadcast_from(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """Overwrite ``tensor`` on every rank of ``group`` with its value on the rank whose rank
    within ``group`` is ``src_group_rank``. Returns the handle when ``async_op``."""
    return dist.broadcast(tensor, group=group, group_src=src_group_rank, async_op=async_op)
