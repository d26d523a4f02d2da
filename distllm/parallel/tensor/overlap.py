"""Overlap engines: a GEMM split into chunks (pieces of its rows), each chunk's collective
running while the next chunk computes. The tensor-parallel layers reach them through
:class:`distllm.parallel.tensor.layers.OverlapPlan`.

Three engines, one per collective (:data:`ENGINES`), each with a sequential twin
(``chunks=0``):

* :func:`matmul_all_reduce` - ``all_reduce(a @ B)``: the row-parallel forward (tensor
  parallelism without sequence parallelism) and the column-parallel input gradient.
  Schedule for chunks ``c`` (pieces from :func:`pipeline_bounds`)::

      GEMM(rows 0)  GEMM(rows 1)  ...  GEMM(rows c-1)  then()      wait all
                    AR(rows 0)    AR(rows 1) ...       AR(rows c-1)

  ``then`` (e.g. the weight-gradient GEMM of the column-parallel backward) runs after the
  last launch, so that the last chunk's all-reduce is hidden too.
* :func:`allgather_matmul` - ``all_gather(a, dim=1) @ B``: the sequence-parallel
  column-parallel forward (and row-parallel backward). The local shard's GEMM runs while
  chunk 0 of the other ranks' shards arrives; chunk ``j``'s GEMM runs while ``j+1`` arrives
  (``j+1`` is launched once ``j`` has arrived, so it never shares the link with ``j``).
* :func:`matmul_reduce_scatter` - ``reduce_scatter(a @ B, dim=1)``: the sequence-parallel
  row-parallel forward (and column-parallel backward); chunk ``j`` of every destination's
  rows is computed, then reduce-scattered while chunk ``j+1`` computes.

Asynchrony: on CPU (gloo) every collective is an ``async_op=True`` work handle that gloo
progresses on its own threads while this thread runs the next GEMM (the reduce-scatter is
:func:`distllm.comm.collectives.reduce_scatter`, on gloo a pairwise exchange of
``isend``/``irecv``; the all-reduce :func:`distllm.comm.collectives.all_reduce`, on 2 gloo
ranks one exchange whose sum is taken when the chunk is waited for). On CUDA each
collective is issued on a communication stream that first waits on an event recorded after
the chunk's GEMM on the compute stream; ``wait`` makes the compute stream wait on an event
recorded after the collective (the host never blocks).

The GEMM is a callback ``mm(a_rows, out_rows)`` writing ``a_rows @ B`` into a row slice of
the output (a contiguous ``(m, n)`` view), so the same engine serves forward and backward.
A callback with an epilogue that reads or writes per-row tensors of its own (the fused
GEMM + bias + GeLU keeps its pre-activation; the fused MLP backward reads it) may also have
``at(q, s, e)``, which :func:`allgather_matmul` calls before each GEMM with the rows it is
about to compute (the rows ``[s, e)`` of rank ``q``'s sequence shard), and ``produce(a_rows)``,
which returns the product in a tensor of its own instead of writing into ``out_rows`` (the
engine places it, as it places its own chunk results, without another copy), and
``begin()``, called once at the start of each run (the overlap tuner runs a schedule several
times: per-run state, such as partial bias gradients, starts again there).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distllm.comm.collectives import all_reduce, reduce_scatter
from distllm.comm.compat import all_gather_into
from distllm.comm.connections import warn_max_connections

__all__ = ["CommContext", "NullComm", "chunk_bounds", "pipeline_bounds", "matmul_all_reduce",
           "allgather_matmul", "matmul_reduce_scatter", "run_engine", "ENGINES"]

MatMul = Callable[[torch.Tensor, torch.Tensor], None]

ENGINES = ("all_reduce", "all_gather", "reduce_scatter")  # each engine's collective


def pipeline_bounds(n: int, chunks: int, growth: float | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of the engines' ``min(chunks, n)`` pieces of ``n`` rows.

    ``growth`` None: with 3 or more pieces the first and the last are half the size of the
    others (weights ``1/2, 1, ..., 1, 1/2``). A pipeline exposes the first piece's compute
    (nothing to send yet) and the last piece's collective (nothing left to compute); halving
    both shrinks what stays exposed in either regime, comm-bound or compute-bound.

    ``growth`` g: piece ``i`` weighs ``g**i`` (a geometric schedule). With g = comm/compute
    per row (GEMM then collective) each piece's GEMM takes as long as the previous piece's
    collective: comm-bound (g > 1), the pieces grow from a small first one, so the
    collective starts early and then never waits; compute-bound (g < 1), they shrink to a
    small last one, whose collective is all that stays exposed. ``overlap="auto"`` derives
    g from its measurement of the two (:mod:`distllm.parallel.tensor.overlap_tuner`)."""
    c = max(1, min(chunks, n))
    if growth is not None and c >= 2:
        weights = [growth**i for i in range(c)]
    elif c < 3:
        return chunk_bounds(n, c)
    else:
        weights = [0.5] + [1.0] * (c - 2) + [0.5]
    total = sum(weights)
    cuts, acc = [0], 0.0
    for wgt in weights[:-1]:
        acc += wgt
        cuts.append(min(n - (c - len(cuts)), max(cuts[-1] + 1, round(n * acc / total))))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``min(chunks, n)`` near-equal pieces of ``n`` rows (sizes differ by
    at most one, larger first, as ``torch.tensor_split``)."""
    c = max(1, min(chunks, n))
    q, r = divmod(n, c)
    out, s = [], 0
    for i in range(c):
        e = s + q + (i < r)
        out.append((s, e))
        s = e
    return out


class _Handle:
    def __init__(self, work=None, event=None, device=None, on_wait=None):
        self.work, self.event, self.device, self.on_wait = work, event, device, on_wait

    def wait(self) -> None:
        if self.event is not None:  # the compute stream waits; the host does not
            torch.cuda.current_stream(self.device).wait_event(self.event)
        elif self.work is not None:
            self.work.wait()
            if self.on_wait is not None:
                self.on_wait()
                self.on_wait = None


class CommContext:
    """A process group plus the means to run its collectives asynchronously (gloo work
    handles on CPU; a communication stream with events on CUDA)."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group))
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.wait_ms = 0.0  # accumulated by wait(); read and reset by the caller
        self.trace: list | None = None  # a list: CPU collectives append (op, start, end)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _issue(self, op: str, out: torch.Tensor, inp: torch.Tensor | None, async_op: bool):
        if op == "all_reduce":
            return all_reduce(out, group=self.group, async_op=async_op)
        if op == "all_gather":
            return all_gather_into(out, inp, group=self.group, async_op=async_op)
        if op == "reduce_scatter":
            return reduce_scatter(out, inp, group=self.group, async_op=async_op)
        raise ValueError(f"unknown collective {op!r}")

    def launch(self, op: str, out: torch.Tensor, inp: torch.Tensor | None = None) -> _Handle:
        """Start ``op`` (``all_reduce`` in place on ``out``; ``all_gather`` / ``reduce_scatter``
        from ``inp`` into ``out``) without waiting for it."""
        if not out.is_cuda:
            t0 = time.perf_counter()
            work = self._issue(op, out, inp, async_op=True)
            on_wait = None
            if self.trace is not None and work is not None:
                on_wait = self._trace_done(work, op, t0)
            return _Handle(work=work, on_wait=on_wait)
        warn_max_connections(out.device)  # once per process: Hopper wants it set to 1
        comm = self._stream(out.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(out.device))  # after the chunk's GEMM
        comm.wait_event(ready)
        with torch.cuda.stream(comm):
            self._issue(op, out, inp, async_op=False)  # enqueued on comm; host does not block
            done = torch.cuda.Event()
            done.record(comm)
        for t in (out, inp):
            if t is not None:
                t.record_stream(comm)
        return _Handle(event=done, device=out.device)

    def _trace_done(self, work, op: str, t0: float) -> Callable[[], None] | None:
        """Append ``(op, start_s, end_s)`` to ``trace`` when gloo completes ``work``. Gloo's
        point-to-point messages (the 2-rank exchange all-reduce) have no completion callback:
        for them the returned function, run when the handle's wait returns, appends the span
        with that time as its end (the latest the messages can have completed)."""
        trace = self.trace

        def done(_fut) -> None:
            trace.append((op, t0, time.perf_counter()))

        try:
            work.get_future().add_done_callback(done)
        except (RuntimeError, AttributeError):  # no future: the end is the wait's return
            if hasattr(work, "works"):  # distllm.comm.collectives' point-to-point handles
                return lambda: trace.append((op, t0, time.perf_counter()))
            trace.append((op, t0, None))
        return None

    def wait(self, h: _Handle) -> None:
        t0 = time.perf_counter()
        h.wait()
        self.wait_ms += (time.perf_counter() - t0) * 1e3

    def run(self, op: str, out: torch.Tensor, inp: torch.Tensor | None = None) -> None:
        """Blocking collective (the sequential schedule)."""
        t0 = time.perf_counter()
        self._issue(op, out, inp, async_op=False)
        t1 = time.perf_counter()
        self.wait_ms += (t1 - t0) * 1e3
        if self.trace is not None:
            self.trace.append((op, t0, t1))


class NullComm(CommContext):
    """A stand-in that moves nothing (all-gather copies the local piece): times the compute
    of a schedule alone, for ``overlap="auto"``'s measurement."""

    def __init__(self, like: CommContext):  # noqa: D107 - no group needed
        self.group, self.world, self.rank = like.group, like.world, like.rank
        self.backend, self.ranks, self._streams, self.wait_ms = like.backend, like.ranks, {}, 0.0
        self.trace = None

    def _issue(self, op, out, inp, async_op):
        if op == "all_gather":
            out.view(self.world, -1).copy_(inp.reshape(1, -1).expand(self.world, -1))
        elif op == "reduce_scatter":
            out.copy_(inp.view(self.world, -1)[self.rank].view_as(out))
        return None


def matmul_all_reduce(a: torch.Tensor, mm: MatMul, n_out: int, comm: CommContext, chunks: int,
                      then: Callable[[], object] | None = None, growth: float | None = None
                      ) -> tuple[torch.Tensor, object]:
    """``all_reduce(a @ B)`` for ``a`` of shape ``(M, K)``, chunked along ``M``; ``then()``
    runs after the last launch (or, with ``chunks=0``, after the blocking all-reduce).
    Returns ``(out (M, n_out), then's result)``."""
    out = a.new_empty(a.shape[0], n_out)
    if chunks <= 0:  # sequential: GEMM, all-reduce, then
        mm(a, out)
        comm.run("all_reduce", out)
        return out, then() if then else None
    handles = []
    for s, e in pipeline_bounds(a.shape[0], chunks, growth):
        mm(a[s:e], out[s:e])  # (m, K) @ (K, N) -> (m, N)
        handles.append(comm.launch("all_reduce", out[s:e]))
    extra = then() if then else None
    for h in handles:
        comm.wait(h)
    return out, extra


def _product(mm: MatMul, rows: torch.Tensor, n_out: int, where: tuple[int, int, int]
             ) -> torch.Tensor:
    """``rows @ B`` as a fresh ``(m, n_out)`` tensor, telling ``mm`` where the rows sit."""
    at = getattr(mm, "at", None)
    if at is not None:
        at(*where)
    produce = getattr(mm, "produce", None)
    if produce is not None:
        return produce(rows)
    res = rows.new_empty(rows.shape[0], n_out)
    mm(rows, res)
    return res


def _gather_chunk(comm: CommContext, a_local: torch.Tensor, s: int, e: int):
    b, _, k = a_local.shape
    piece = a_local[:, s:e].reshape(b * (e - s), k)  # (b*c, k), contiguous copy
    buf = a_local.new_empty(comm.world * piece.shape[0], k)  # (tp*b*c, k)
    return buf, comm.launch("all_gather", buf, piece)


def allgather_matmul(a_local: torch.Tensor, mm: MatMul, n_out: int, comm: CommContext,
                     chunks: int, growth: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = all_gather(a_local, dim=1)`` and ``a @ B`` for ``a_local`` of shape
    ``(b, s/tp, K)``; returns ``(a (b, s, K), out (b, s, n_out))``, rank ``r``'s rows at
    ``[r*s/tp, (r+1)*s/tp)``."""
    b, sl, k = a_local.shape
    tp, r = comm.world, comm.rank
    begin = getattr(mm, "begin", None)
    if begin is not None:
        begin()
    if chunks <= 0:  # sequential: all-gather, then one GEMM
        buf = a_local.new_empty(tp * b * sl, k)
        comm.run("all_gather", buf, a_local.reshape(b * sl, k))
        # contiguous, so that it views as rows: (b, tp, 1, K) transposed is not, at s/tp = 1
        a_full = buf.view(tp, b, sl, k).transpose(0, 1).contiguous().view(b, tp * sl, k)
        if getattr(mm, "at", None) is None and getattr(mm, "produce", None) is None:
            out = a_local.new_empty(b * tp * sl, n_out)
            mm(a_full.view(-1, k), out)
            return a_full, out.view(b, tp * sl, n_out)
        out = a_local.new_empty(b, tp, sl, n_out)
        for q in range(tp):  # an epilogue with per-row state: one GEMM per source rank
            rows = a_full.view(b, tp, sl, k)[:, q].reshape(b * sl, k)
            out[:, q] = _product(mm, rows, n_out, (q, 0, sl)).view(b, sl, n_out)
        return a_full, out.view(b, tp * sl, n_out)
    a_full = a_local.new_empty(b, tp, sl, k)
    out = a_local.new_empty(b, tp, sl, n_out)
    bounds = pipeline_bounds(sl, chunks, growth)
    pending = _gather_chunk(comm, a_local, *bounds[0])
    a_full[:, r] = a_local
    local = _product(mm, a_local.reshape(b * sl, k), n_out, (r, 0, sl))  # while chunk 0 travels
    out[:, r] = local.view(b, sl, n_out)
    for j, (s, e) in enumerate(bounds):
        buf, h = pending
        comm.wait(h)
        if j + 1 < len(bounds):  # chunk j+1 travels alone (full link) while j computes
            pending = _gather_chunk(comm, a_local, *bounds[j + 1])
        c = e - s
        bufv = buf.view(tp, b, c, k)
        for q in range(tp):
            if q == r:
                continue
            a_full[:, q, s:e] = bufv[q]
            res = _product(mm, bufv[q].view(b * c, k), n_out, (q, s, e))  # (b*c, K) @ (K, N)
            out[:, q, s:e] = res.view(b, c, n_out)
    return a_full.view(b, tp * sl, k), out.view(b, tp * sl, n_out)


def matmul_reduce_scatter(a: torch.Tensor, mm: MatMul, n_out: int, comm: CommContext,
                          chunks: int, then: Callable[[], object] | None = None,
                          growth: float | None = None) -> tuple[torch.Tensor, object]:
    """``reduce_scatter(a @ B, dim=1)`` for ``a`` of shape ``(b, s, K)``: this rank keeps rows
    ``[r*s/tp, (r+1)*s/tp)`` of the sum over ranks, ``(b, s/tp, n_out)``; ``then()`` runs
    after the last launch. Returns ``(out, then's result)``."""
    b, s_full, k = a.shape
    tp = comm.world
    sl = s_full // tp
    av = a.reshape(b, tp, sl, k)
    out = a.new_empty(b, sl, n_out)
    if chunks <= 0:  # sequential: one GEMM, reduce-scatter, then
        res = a.new_empty(tp * b * sl, n_out)
        mm(av.transpose(0, 1).reshape(tp * b * sl, k), res)  # rows grouped by destination
        comm.run("reduce_scatter", out.view(b * sl, n_out), res)
        return out, then() if then else None
    pending = []
    for s, e in pipeline_bounds(sl, chunks, growth):
        c = e - s
        piece = av[:, :, s:e].transpose(0, 1).reshape(tp * b * c, k)  # (tp, b, c, K) rows
        res = a.new_empty(tp * b * c, n_out)
        mm(piece, res)
        dst = a.new_empty(b * c, n_out)
        pending.append((s, e, dst, comm.launch("reduce_scatter", dst, res)))
    extra = then() if then else None
    for s, e, dst, h in pending:
        comm.wait(h)
        out[:, s:e] = dst.view(b, e - s, n_out)
    return out, extra


def run_engine(kind: str, a: torch.Tensor, mm: MatMul, n_out: int, comm: CommContext,
               chunks: int, then: Callable[[], object] | None = None,
               growth: float | None = None):
    """Run the engine of collective ``kind`` (one of :data:`ENGINES`) with ``chunks`` pieces
    (0: the sequential schedule) sized by :func:`pipeline_bounds` (``growth``). Returns
    ``(out, then's result)``; for ``all_gather`` ``out`` is ``(gathered input, product)``."""
    if kind == "all_reduce":
        return matmul_all_reduce(a, mm, n_out, comm, chunks, then, growth)
    if kind == "all_gather":
        full, out = allgather_matmul(a, mm, n_out, comm, chunks, growth)
        return (full, out), then() if then else None
    if kind == "reduce_scatter":
        return matmul_reduce_scatter(a, mm, n_out, comm, chunks, then, growth)
    raise ValueError(f"unknown overlap engine {kind!r}: use one of {ENGINES}")
