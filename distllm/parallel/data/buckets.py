"""Gradient buckets: flat buffers whose reduction overlaps the backward pass.

Parameters are grouped into flat buckets in *reverse order of registration* (backward
produces the last layer's gradients first). The first bucket is small (1 MiB, as in
PyTorch DDP) so that the first reduction starts early; the others hold up to
``bucket_cap_mb``. Every parameter gets a post-accumulate-grad hook; when the last
gradient of a bucket has been accumulated the bucket's collective is launched
asynchronously, while autograd goes on with earlier layers:

* ``mode="all_reduce"`` (DDP, ZeRO-0/1): the bucket is averaged in place;
* ``mode="reduce_scatter"`` (ZeRO-2/3): rank ``r`` receives the average of the slice
  ``[r*L/N, (r+1)*L/N)`` of the (padded) bucket, accumulated into a persistent shard.

Buckets are launched strictly in index order (bucket ``i`` waits for ``0..i-1``), so the
collectives of every rank are issued in the same order even when gradients arrive in a
different order on different ranks.

A gradient reaches its bucket from the hook: its first contribution of the cycle is
divided by the group size straight into the bucket (``torch.div(grad, n, out=slice)``: one
pass that is both the copy and the averaging, bit for bit the same as a copy then a
division), later ones are added, and ``param.grad`` is set to ``None`` so that autograd's
own tensor is freed. A slice that was not divided that way (accumulated under ``no_sync``,
or cast from another dtype: the division then runs in the bucket's dtype) is divided at
launch. With ``as_view=True`` (same dtype, persistent buffers; DDP) every ``param.grad``
is made a view of its bucket when the cycle finishes, so after ``backward`` the gradients
read like torch DDP's; a ``.grad`` that is still that view when the next backward runs
(``zero_grad(set_to_none=False)``, or no ``zero_grad``) is accumulated into by autograd in
place. Compared with zeroing the bucket and letting autograd add into it, this saves a
fill, a read of the bucket and the separate division pass per step.

A step is a *cycle*: hooks fire (under ``no_sync`` they only accumulate), buckets launch,
then :meth:`GradBuckets.finish` launches whatever did not launch (parameters that got no
gradient contribute zeros, so unused parameters never hang the reduction), waits for every
collective and leaves the results in place. ``finish`` is idempotent within a cycle.

``overlap=False`` keeps the hooks (each gradient is still divided into its slice as it
lands, and autograd's tensor freed) but launches nothing from them: every bucket's
collective starts in :meth:`GradBuckets.finish`, after backward, in bucket order. The
same copies and the same collectives, one after the other: the reference that tells what
the overlap itself gains (Megatron-LM's ``overlap_grad_reduce`` and DeepSpeed's
``overlap_comm`` turned off), and a way to rule the overlap out when debugging.
``overlap="auto"`` decides between the two by a trial in the step where that can pay (on
CPU, all-reduce mode; see :mod:`distllm.parallel.data.reduction_trial`), else overlaps.

Used by :class:`~distllm.parallel.data.ddp.DistributedDataParallel` (all-reduce) and
:class:`~distllm.parallel.data.zero.ZeroOptimizer` (all-reduce at stages 0-1,
reduce-scatter at stages 2-3).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from distllm.comm.collectives import all_reduce, reduce_scatter, reduce_scatter_by_all_reduce
from distllm.comm.compat import reduce_scatter_into
from distllm.diagnostics.timing import max_over_ranks
from distllm.parallel.data.bucket_layout import Bucket
from distllm.parallel.data.hooks import remove_hooks, removed_with, weak_hook
from distllm.parallel.data.reduction_trial import reduction_schedule

__all__ = ["GradBuckets", "REDUCE_SCATTER_IMPLS"]

# How reduce_scatter mode reduces a bucket: "auto" is the shared reduce-scatter, which
# works around gloo's slow collective; "reduce_scatter" always the backend's own collective;
# "all_reduce" always an all-reduce of the bucket, of which this rank keeps its slice.
REDUCE_SCATTER_IMPLS = {
    "auto": reduce_scatter,
    "reduce_scatter": reduce_scatter_into,
    "all_reduce": reduce_scatter_by_all_reduce,
}

class GradBuckets:
    """Bucketed, asynchronous gradient reduction driven by post-accumulate-grad hooks.

    Args:
        buckets: parameter lists, bucket 0 first (see
            :func:`~distllm.parallel.data.bucket_layout.assign_buckets`).
        group: the data-parallel process group (``None`` or size 1: nothing is sent).
        mode: ``"all_reduce"`` or ``"reduce_scatter"``.
        dtype: dtype of the flat buffers, i.e. of the reduction (fp32 for mixed precision).
        as_view: make each ``param.grad`` a view of its persistent bucket (needs
            ``param.dtype == dtype`` and ``persistent=True``).
        persistent: keep the full buffers between steps (all_reduce mode); otherwise a
            buffer exists from its first gradient until its reduction completed.
        on_bucket_ready: called with the bucket when its last gradient landed (before launch).
        on_finish: called at the end of :meth:`finish` (e.g. to free gathered parameters).
        pad_to: pad each bucket to a multiple of this (default: the group size in
            reduce_scatter mode, else 1); ZeRO-1 pads to the group size to shard states.
        reduce_scatter_impl: how reduce_scatter mode reduces (a key of
            :data:`REDUCE_SCATTER_IMPLS`): ``"reduce_scatter"`` (the backend's collective),
            ``"all_reduce"`` (all-reduce the bucket, keep this rank's slice), or ``"auto"``:
            :func:`distllm.comm.collectives.reduce_scatter` (the collective on NCCL, a
            faster substitute on gloo).
        finish_on_backward_end: queue :meth:`finish` at the end of the backward pass in which
            the first synchronised gradient landed (the drop-in DDP behaviour). Turn it off
            when one step's gradients come from several ``autograd.backward`` calls (a
            pipeline's split weight-gradient passes) and call :meth:`finish` yourself.
        overlap: launch each bucket's collective from the hook of its last gradient, while
            backward goes on (``True``, the default); ``False``: launch them all in
            :meth:`finish`; ``"auto"``: a trial in the step decides (see above).

    Attributes:
        overlap: how the current cycle reduces (``True``: during backward).
        overlap_reason: why (the trial's decision and its figures, under ``"auto"``).
        trial: the :class:`~distllm.parallel.data.reduction_trial.ReductionTrial` of
            ``overlap="auto"`` where it runs, else ``None``.
        launch_log: ``(bucket index, perf_counter time, hooks fired so far this cycle)``
            for each launch of the current (or last) cycle, to check that reduction overlaps
            backward; :attr:`launches_in_backward` counts this cycle's launches from a hook.
    """

    def __init__(self, buckets: list[list[torch.nn.Parameter]], *, group, mode: str,
                 dtype: torch.dtype, as_view: bool, persistent: bool,
                 on_bucket_ready: Callable[[Bucket], None] | None = None,
                 finish_on_backward_end: bool = True, pad_to: int | None = None,
                 on_finish: Callable[[], None] | None = None,
                 reduce_scatter_impl: str = "auto", overlap: bool | str = True) -> None:
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"mode={mode!r}: use 'all_reduce' or 'reduce_scatter'")
        if as_view and not persistent:
            raise ValueError("as_view=True needs persistent=True (a grad view must stay valid)")
        self.group = group
        self.nranks = dist.get_world_size(group) if group is not None else 1
        self.mode, self.dtype, self.as_view, self.persistent = mode, dtype, as_view, persistent
        self.on_bucket_ready = on_bucket_ready
        self.on_finish = on_finish
        self.pad_to = pad_to or (self.nranks if mode == "reduce_scatter" else 1)
        if reduce_scatter_impl not in REDUCE_SCATTER_IMPLS:
            raise ValueError(f"reduce_scatter_impl={reduce_scatter_impl!r}: use one of "
                             f"{sorted(REDUCE_SCATTER_IMPLS)}")
        self._reduce_scatter = REDUCE_SCATTER_IMPLS[reduce_scatter_impl]
        self.finish_on_backward_end = finish_on_backward_end
        self.buckets: list[Bucket] = []
        self.where: dict[torch.nn.Parameter, tuple[Bucket, int]] = {}
        for i, ps in enumerate(buckets):
            self._add_bucket(i, ps)
        self._setup_overlap(overlap)
        self.sync_enabled = True
        self._next = 0  # next bucket to launch
        self._synced = False  # finish() already ran in this cycle
        self._callback_queued = False
        self._hooks_fired = 0
        self.launch_log: list[tuple[int, float, int]] = []
        self.launches_in_backward = 0  # launches from a hook, i.e. while backward ran
        self._views: dict[torch.nn.Parameter, Tensor] = {}  # persistent: each param's slice
        # weak: the parameters' hooks must not keep a dropped wrapper alive (see hooks.py)
        hook = weak_hook(self, GradBuckets._hook)
        self._handles = removed_with(
            self, [p.register_post_accumulate_grad_hook(hook) for p in self.where])

    def remove_hooks(self) -> None:
        """Remove the parameters' gradient hooks (a newer wrapper owns them)."""
        remove_hooks(self._handles)

    def _setup_overlap(self, overlap: bool | str) -> None:
        device = self.buckets[0].params[0].device if self.buckets else torch.device("cpu")
        group = self.group
        self.trial, self.overlap, self._reason = reduction_schedule(
            overlap, mode=self.mode, nranks=self.nranks, device=device,
            what=f"gradient all-reduce ({len(self.buckets)} buckets, {self.nranks} ranks)",
            max_over_ranks=lambda vals: max_over_ranks(vals, group, device))
        self._cycle_t0: float | None = None

    @property
    def tuning(self) -> bool:
        """Whether ``"auto"``'s trial is still running (its synchronised cycles alternate
        between reducing during and after backward)."""
        return self.trial is not None and not self.trial.done

    @property
    def overlap_reason(self) -> str:
        """Why the buckets reduce as they do (under ``"auto"``, the trial's state or its
        decision with the figures)."""
        return self.trial.reason if self.trial is not None else self._reason

    # --- layout ------------------------------------------------------------------------
    def _add_bucket(self, i: int, ps: list[torch.nn.Parameter]) -> None:
        offsets, n = [], 0
        for p in ps:
            if self.as_view and p.dtype != self.dtype:
                raise ValueError(
                    f"as_view needs param dtype {p.dtype} == bucket dtype {self.dtype}")
            offsets.append(n)
            n += p.numel()
        pad = -n % self.pad_to
        b = Bucket(i, list(ps), offsets, [p.shape for p in ps], n + pad, nranks=self.nranks)
        if self.persistent:
            b.buffer = torch.zeros(b.numel, dtype=self.dtype, device=ps[0].device)
        self.buckets.append(b)
        for j, p in enumerate(ps):
            if p in self.where:
                raise ValueError("a parameter appears twice in the buckets")
            self.where[p] = (b, j)

    def view(self, p: torch.nn.Parameter) -> Tensor:
        """``p``'s slice of its bucket buffer, shaped like ``p`` (the buffer must exist);
        made once per parameter when the buffers are persistent."""
        v = self._views.get(p)
        if v is not None:
            return v
        b, j = self.where[p]
        assert b.buffer is not None
        v = b.buffer[b.offsets[j]: b.offsets[j] + b.shapes[j].numel()].view(b.shapes[j])
        if self.persistent:
            self._views[p] = v
        return v

    def _ensure_buffer(self, b: Bucket) -> Tensor:
        """The bucket's buffer. A new one is not zeroed (its first gradient per parameter is
        written in, and what none wrote is zeroed at launch: one pass less over the bucket),
        except for the padding after the last parameter."""
        if b.buffer is None:
            b.buffer = torch.empty(b.numel, dtype=self.dtype, device=b.params[0].device)
            end = b.offsets[-1] + b.shapes[-1].numel()
            b.buffer[end:].zero_()
            b.written.clear()
            b.scaled.clear()
        elif b.fresh:
            b.written.clear()
            b.scaled.clear()
        b.fresh = False
        return b.buffer

    # --- the hook ------------------------------------------------------------------------
    def _accumulate(self, p: torch.nn.Parameter, divide: bool) -> None:
        """Bring ``p``'s gradient of this cycle into its slice (zeros when it has none);
        ``divide``: a first contribution is divided by the group size on the way in."""
        b, j = self.where[p]
        self._ensure_buffer(b)
        v = self.view(p)
        g = p.grad
        if g is not None and g.data_ptr() == v.data_ptr():
            b.written.add(j)  # autograd accumulated into the slice itself
            return
        if j not in b.written:
            if g is None:
                v.zero_()
                b.scaled.add(j)  # zeros need no division
            elif divide and g.dtype == v.dtype:
                torch.div(g, self.nranks, out=v)
                b.scaled.add(j)
            else:
                v.copy_(g)  # casts, e.g. bf16 -> fp32
            b.written.add(j)
        elif g is not None:
            if j in b.scaled:
                v.add_(g, alpha=1.0 / self.nranks)
            else:
                v.add_(g)
        p.grad = None

    def _install_views(self) -> None:
        """``as_view``: every ``param.grad`` becomes its slice of the bucket."""
        for p in self.where:
            p.grad = self.view(p)

    @torch.no_grad()
    def _hook(self, p: torch.nn.Parameter) -> None:
        b, j = self.where[p]
        if b.launched:  # (under no_sync too: it would be added to a buffer being reduced)
            raise RuntimeError(
                "a gradient arrived for a bucket whose reduction was already launched in this "
                "step (a backward pass after the synchronised one?): run all but the last "
                "micro-batch under no_sync(), before the synchronised one, or call "
                "finish_grad_sync() between backward passes")
        self._synced = False
        self._accumulate(p, divide=self.sync_enabled and self.nranks > 1)
        if not self.sync_enabled:
            return
        if self._hooks_fired == 0 and self.tuning:
            self._cycle_t0 = time.perf_counter()  # the trial times the cycle from here
        self._hooks_fired += 1
        if self.finish_on_backward_end and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        b.ready.add(j)
        if len(b.ready) == len(b.params):
            if self.on_bucket_ready is not None:
                self.on_bucket_ready(b)
            if self.overlap:
                self._launch_in_order(in_backward=True)

    @torch.no_grad()
    def mark_unused(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Count ``params`` as ready with a zero contribution this step (found unreachable
        from the loss), so their buckets need not wait for the end of backward."""
        if not self.sync_enabled:
            return
        for p in params:
            b, j = self.where[p]
            if b.launched or j in b.ready:
                continue
            self._synced = False
            self._accumulate(p, divide=self.nranks > 1)
            b.ready.add(j)
        if self.overlap:
            self._launch_in_order(in_backward=False)

    # --- launching and completing ---------------------------------------------------------
    def _launch_in_order(self, in_backward: bool, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and len(b.ready) < len(b.params):
                return
            self._launch(b, in_backward)
            self._next += 1
            self._poll()

    def _launch(self, b: Bucket, in_backward: bool) -> None:
        buf = self._ensure_buffer(b)
        for j, p in enumerate(b.params):  # a parameter without a gradient contributes zeros
            if j not in b.written:
                self._accumulate(p, divide=self.nranks > 1)
        b.launched = True
        if self._next == 0:  # a new cycle's first launch
            self.start_cycle_log()
        self.launch_log.append((b.index, time.perf_counter(), self._hooks_fired))
        self.launches_in_backward += int(in_backward)
        if self.nranks > 1 and len(b.scaled) < len(b.params):  # average (gloo has no AVG)
            if not b.scaled:
                buf.div_(self.nranks)
            else:
                for j, p in enumerate(b.params):
                    if j not in b.scaled:
                        self.view(p).div_(self.nranks)
        if self.mode == "all_reduce":
            if self.nranks > 1:
                b.work = all_reduce(buf, group=self.group, async_op=True)
            return
        # a shard holding nothing of this cycle yet receives the reduction itself
        b.out = b.shard if b.shard is not None and b.shard_fresh else torch.empty(
            b.shard_numel, dtype=self.dtype, device=buf.device)
        if self.nranks > 1:
            b.work = self._reduce_scatter(b.out, buf, group=self.group, async_op=True)
        else:
            b.out.copy_(buf)

    def _complete(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        if self.mode == "reduce_scatter" and b.out is not None:
            if b.shard is None or b.shard_fresh:
                b.shard = b.out  # (the shard itself when it existed: reduced into)
            else:
                b.shard.add_(b.out)
            b.shard_fresh = False
            b.out = None
            if not self.persistent:
                b.buffer = None  # the full gradient is not kept
            else:
                b.fresh = True

    def _poll(self) -> None:
        """Complete (and free) the launched buckets whose collective is done."""
        if self.mode != "reduce_scatter":
            return
        for b in self.buckets[: self._next]:
            if b.out is not None and (b.work is None or b.work.is_completed()):
                self._complete(b)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch every bucket not launched yet (zeros for params without a gradient), wait
        for all reductions and reset for the next cycle. A no-op if already done this cycle."""
        self._callback_queued = False
        if self._synced or not self.sync_enabled:
            return
        t_finish = time.perf_counter()
        self._launch_in_order(in_backward=False, force=True)
        for b in self.buckets:
            self._complete(b)
            b.ready.clear()
            b.launched = False
            b.scaled.clear()  # what the buffer holds now is a whole average
            if self.as_view:  # the .grad views hold it: a new .grad overwrites its slice
                b.fresh = True
        if self.as_view:
            self._install_views()
        self._next = 0
        self._hooks_fired = 0
        self._synced = True
        if self.tuning:
            self._record_cycle(t_finish)
        if self.on_finish is not None:
            self.on_finish()

    def _record_cycle(self, t_finish: float) -> None:
        """Give the trial this cycle's time (from its first synchronised gradient, or from
        ``finish`` on a rank where none landed: every rank records every cycle, so the
        decision's collective pairs up) and set how the next cycle reduces."""
        t0 = self._cycle_t0 if self._cycle_t0 is not None else t_finish
        self._cycle_t0 = None
        self.trial.record((time.perf_counter() - t0) * 1e3)
        self.overlap = self.trial.overlap_now()

    def start_cycle_log(self) -> None:
        """Clear :attr:`launch_log` and the count of launches from backward (done at each
        cycle's first launch)."""
        self.launch_log = []
        self.launches_in_backward = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collective) inside the context."""
        prev = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = prev

    def mark_consumed(self) -> None:
        """The next cycle's first gradients rewrite the buffers and shards instead of adding
        to them; what they hold now stays readable until then."""
        for b in self.buckets:
            b.fresh = True
            b.shard_fresh = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this cycle's gradients: buffers and shards are rewritten on next use.
        ``as_view``: ``param.grad`` becomes ``None`` (the next gradient is divided into its
        slice), or with ``set_to_none=False`` stays the bucket's view, zeroed in place; a
        ``.grad`` that is None stays None, as ``nn.Module.zero_grad`` leaves it (an optimizer
        skips such a parameter: no weight decay, no moment update)."""
        self.mark_consumed()
        if self.as_view:
            if set_to_none:
                for p in self.where:
                    p.grad = None
            else:
                had = {p for p in self.where if p.grad is not None}
                for b in self.buckets:
                    b.buffer.zero_()
                    b.fresh = False
                    b.written = {j for j, p in enumerate(b.params) if p in had}
                    b.scaled.clear()
                for p in had:
                    p.grad = self.view(p)
        self._synced = False

    def params(self) -> Iterable[torch.nn.Parameter]:
        """Every bucketed parameter, bucket 0's first."""
        return self.where.keys()
