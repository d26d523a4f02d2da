"""Point-to-point transfers between pipeline stages: batched asynchronous isend/irecv.

Messages are named by ``(kind, mb, dst_stage)`` with ``kind`` ``"F"`` (an activation going to
stage ``dst_stage``) or ``"B"`` (the gradient of stage ``dst_stage``'s output). The executor
*posts* sends and receives as its schedule says; consecutive posts go out together as one
``dist.batch_isend_irecv`` at the next :meth:`StageComm.flush`; a receive is waited for only
by the compute that consumes it; a send's tensor is dropped at the first flush after its work
reports completion (``is_completed``: NCCL, the dry run's fake backend), and the sends still
held are waited for at the end of the step. gloo's send works report completion only through
``wait``: there an activation's send is waited for (without blocking: it is done) and dropped
when the gradient of that micro-batch comes back from the stage it went to, which consumed
it; its other sends (gradients, evaluation's activations) are kept to the step's end.

Shapes without round trips: a gradient has the shape of the output its receiver computed
(known locally); an activation's shape and dtype travel once, as a small header sent in the
same batch just before the first activation on each stage edge, and are cached for the
life of the executor (micro-batch shapes are fixed; a sender whose shape changes raises).
With ``every_header`` (forward-only evaluation, whose batch shapes may vary) every activation
carries its header and is received only when consumed. Receives whose shape is not known yet
wait in a per-peer queue, so every pair of ranks posts its receives in the order of the
matching sends (needed by NCCL, which matches messages in order; gloo also gets a distinct
tag per message).

Channels: on NCCL each direction between two pipeline ranks is a 2-rank process group of its
own (:func:`p2p_channel_groups`). NCCL runs the operations of one communicator in order on
one stream, so with a single group a receive posted ahead (waiting for a later send of the
peer) would hold up the sends queued behind it on both ranks: a deadlock in almost every
schedule. On a unidirectional channel the i-th send meets the i-th receive, so a schedule is
deadlock-free exactly when ``simulate`` finds it so. Gloo runs each operation independently:
one group with a tag per message suffices (``p2p_channels=True`` forces channels there too).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from distllm.comm.collectives import backend_for

__all__ = ["StageComm", "p2p_channel_groups"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool]
_HDR = 10  # [ndim, dtype code, up to 8 dims]

Key = tuple[str, int, int]  # (kind, mb, dst_stage)


def _encode(shape: torch.Size, dtype: torch.dtype, device) -> torch.Tensor:
    if len(shape) > _HDR - 2 or dtype not in _DTYPES:
        raise ValueError(f"activation of shape {tuple(shape)} and dtype {dtype} cannot be sent "
                         f"between stages: at most {_HDR - 2} dims, dtype in {_DTYPES}")
    vals = [len(shape), _DTYPES.index(dtype), *shape] + [0] * (_HDR - 2 - len(shape))
    return torch.tensor(vals, dtype=torch.int64, device=device)


def _decode(h: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    vals = h.tolist()
    return torch.Size(vals[2:2 + vals[0]]), _DTYPES[vals[1]]


def p2p_channel_groups(dims, wrap: bool) -> dict[tuple[int, int], dist.ProcessGroup]:
    """``{(src, dst): group}`` for this rank's channels: one 2-rank group per direction between
    neighbouring pipeline ranks (and last -> first with ``wrap``, for interleaving). Every rank
    creates every pipeline's groups in the same order (``new_group`` is collective); each is
    started with one all-reduce between its two ranks."""
    edges: list[tuple[int, int]] = []
    for ranks in dims.groups["pp"]:
        hops = list(zip(ranks[:-1], ranks[1:], strict=True))
        if wrap:
            hops.append((ranks[-1], ranks[0]))
        for a, b in hops:
            for e in ((a, b), (b, a)):
                if a != b and e not in edges:
                    edges.append(e)
    mine = {}
    for src, dst in edges:
        g = dist.new_group([src, dst], timeout=dims.timeout)
        if dims.rank in (src, dst):
            mine[(src, dst)] = g
            # start the communicator now, in this global order: started lazily by a first
            # send, it would block the sender until the receiver's first receive on it
            dist.all_reduce(torch.zeros(1, device=dims.device), group=g)
    return mine


class StageComm:
    """Batched P2P between pipeline ranks of one pipeline (global ranks ``peers``).

    Args:
        rank: this process's global rank.
        group: the pipeline's process group (``dims.pp_group``).
        device: where receive buffers live (``dims.device``).
        num_stages: stages of the whole pipeline (for tags).
        every_header: send each activation's shape with it (evaluation).
        channels: ``p2p_channel_groups(...)``, or None for one group (gloo).
    """

    def __init__(self, rank: int, group, device: torch.device, num_stages: int,
                 every_header: bool = False, channels: dict | None = None) -> None:
        self.rank, self.group, self.device, self.stages = rank, group, device, num_stages
        self.channels = channels or {}  # (src, dst) global ranks -> a group of its own
        self.every_header = every_header  # a header before every activation: any shapes
        backend = backend_for(group, device.type)
        self.use_tags = backend != "nccl"
        self.shapes: dict[tuple[str, int], tuple[torch.Size, torch.dtype]] = {}
        self._sent_shape: dict[tuple[str, int], tuple[torch.Size, torch.dtype]] = {}
        # posted operations, each with the message it sends (None: a header, a receive)
        self._ops: list[tuple[dist.P2POp, Key | None]] = []
        self._recv: dict[Key, tuple[torch.Tensor, list]] = {}
        self._deferred: dict[int, deque[Key]] = {}
        self._local: dict[Key, torch.Tensor] = {}
        # the sends issued and not yet seen complete, with their tensors (kept alive until
        # then); those seen complete are dropped at each flush, so that a rank holds the
        # sends in flight, not every message of the step. gloo's send works report
        # completion only through wait: there they are not asked at each flush (the
        # step's hot path); an activation's is dropped when its gradient comes back
        # (_release), the others waited for in finish()
        self._sends: list[tuple[dist.Work, torch.Tensor, Key | None]] = []
        self._drops = backend != "gloo"

    def _tag(self, key: Key, header: bool) -> int:
        kind, mb, stage = key
        if not self.use_tags:
            return 0
        return ((mb * 2 + (kind == "B")) * self.stages + stage) * 2 + header

    def _g(self, peer: int, sending: bool):
        edge = (self.rank, peer) if sending else (peer, self.rank)
        return self.channels.get(edge, self.group)

    # --- posting -------------------------------------------------------------------
    def send(self, key: Key, tensor: torch.Tensor, peer: int) -> None:
        """Post the send of ``tensor`` (detached, contiguous) as message ``key`` to ``peer``."""
        t = tensor.detach().contiguous()
        if peer == self.rank:
            self._local[key] = t
            return
        edge = (key[0], key[2])
        sig = (t.shape, t.dtype)
        if key[0] == "F":
            if edge not in self._sent_shape or self.every_header:
                self._sent_shape[edge] = sig
                hdr = _encode(t.shape, t.dtype, t.device)
                tag = self._tag(key, True)
                self._ops.append((dist.P2POp(dist.isend, hdr, peer, self._g(peer, True), tag),
                                  None))
            elif self._sent_shape[edge] != sig:
                raise ValueError(
                    f"stage {key[2] - 1} output changed from {tuple(self._sent_shape[edge][0])} "
                    f"{self._sent_shape[edge][1]} to {tuple(t.shape)} {t.dtype}: the pipeline "
                    "needs one micro-batch shape (batch size / --micro-batches and sequence "
                    "length) for the executor's life; build a new executor for another shape")
        tag = self._tag(key, False)
        self._ops.append((dist.P2POp(dist.isend, t, peer, self._g(peer, True), tag), key))

    def recv(self, key: Key, peer: int) -> None:
        """Post the receive of message ``key`` from ``peer`` (deferred while its shape is
        unknown, keeping this peer's receives in send order)."""
        if peer == self.rank:
            return
        q = self._deferred.setdefault(peer, deque())
        q.append((key, peer))
        self._drain(peer, upto=None)

    def _drain(self, peer: int, upto: Key | None) -> None:
        q = self._deferred.get(peer)
        while q:
            key, _ = q[0]
            edge = (key[0], key[2])
            if edge not in self.shapes:
                if upto is None:
                    return
                if key[0] == "B":
                    raise RuntimeError(f"gradient {key} expected before its forward ran")
                self._read_header(key, peer)
            q.popleft()
            shape, dtype = self.shapes.pop(edge) if self.every_header else self.shapes[edge]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            tag = self._tag(key, False)
            self._ops.append((dist.P2POp(dist.irecv, buf, peer, self._g(peer, False), tag),
                              None))
            self._recv[key] = (buf, [])
            if key == upto:
                return

    def _read_header(self, key: Key, peer: int) -> None:
        self.flush()
        hdr = torch.empty(_HDR, dtype=torch.int64, device=self.device)
        op = dist.P2POp(dist.irecv, hdr, peer, self._g(peer, False), self._tag(key, True))
        for w in dist.batch_isend_irecv([op]):
            w.wait()
        self.shapes[(key[0], key[2])] = _decode(hdr)

    def flush(self) -> None:
        """Issue every posted operation as one ``batch_isend_irecv``, and drop the sends that
        have completed."""
        self._drop_sent()
        if not self._ops:
            return
        ops, self._ops = self._ops, []
        by_group: dict[int, list[tuple[dist.P2POp, Key | None]]] = {}
        for op, key in ops:  # one batch per group (per channel)
            by_group.setdefault(id(op.group), []).append((op, key))
        done = []  # (op, its message or None, its work)
        for batch in by_group.values():
            works = dist.batch_isend_irecv([op for op, _ in batch])
            if len(works) == len(batch):
                done += [(op, key, w) for (op, key), w in zip(batch, works, strict=True)]
            elif works:  # one coalesced work for the whole batch (NCCL)
                done += [(op, key, works[0]) for op, key in batch]
        self._sends += [(w, op.tensor, key) for op, key, w in done if op.op is dist.isend]
        for _key, (buf, ws) in self._recv.items():
            if not ws:
                ws.extend(w for op, _, w in done if op.tensor is buf)

    # --- waiting -------------------------------------------------------------------
    def wait(self, key: Key, peer: int) -> torch.Tensor:
        """The received tensor of message ``key`` (waits for it)."""
        if peer == self.rank:
            return self._local.pop(key)
        if key not in self._recv:
            self._drain(peer, upto=key)
        self.flush()
        buf, works = self._recv.pop(key)
        for w in works:
            w.wait()
        if key[0] == "B" and not self._drops:
            self._release(("F", key[1], key[2] + 1))
        return buf

    def _release(self, sent: Key) -> None:
        """Wait for and drop the send of message ``sent``, which its receiver has consumed
        (it sent back what it computed from it): gloo's sends, which do not report
        completion otherwise."""
        live = []
        for w, t, k in self._sends:
            if k == sent:
                w.wait()
            else:
                live.append((w, t, k))
        self._sends = live

    def _drop_sent(self) -> None:
        """Forget the sends that have completed (``is_completed`` does not block; a failed
        send raises its error here, from its ``wait``): their tensors may be freed."""
        if self._drops and self._sends:
            live = []
            for w, t, k in self._sends:
                if w.is_completed():
                    w.wait()
                else:
                    live.append((w, t, k))
            self._sends = live

    def finish(self) -> None:
        """Wait for every send of the step (their buffers may then be freed)."""
        self.flush()
        for w, _, _ in self._sends:
            w.wait()
        self._sends.clear()
        if self._recv or any(self._deferred.values()) or self._local:
            raise RuntimeError("pipeline step ended with messages posted but never consumed")
