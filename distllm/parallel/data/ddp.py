"""``DistributedDataParallel``: bucketed gradient all-reduce overlapped with backward.

Forward: no collective (the wrapped module runs as is).
Backward: each bucket of gradients is averaged with an asynchronous all-reduce over the
DP group of ``dims`` as soon as its last gradient has been accumulated, while autograd goes
on with earlier layers (see :mod:`distllm.parallel.data.buckets`). At the end of the backward pass
the remaining buckets are launched and all reductions are waited for, so that after
``loss.backward()`` every ``param.grad`` holds the DP average, as with
``torch.nn.parallel.DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distllm.comm.collectives import all_reduce
from distllm.parallel.data.bucket_layout import FIRST_BUCKET_BYTES, assign_buckets, bucket_bytes
from distllm.parallel.data.buckets import GradBuckets
from distllm.parallel.data.grad_norm import clip_grad_norm_, clip_grad_norm_and_sum_
from distllm.parallel.data.hooks import take_over
from distllm.parallel.data.replicas import broadcast_from_dp0, dp_group_of
from distllm.parallel.mesh import ParallelDims

__all__ = ["DistributedDataParallel", "clip_grad_norm_"]


def check_module(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s trainable parameters; a clear error when it is no module or has none."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"module {type(module).__name__} has no parameters that require grad: "
            "there is nothing to synchronise (wrap the module that holds the weights)")
    return params


class DistributedDataParallel(nn.Module):
    """Data parallelism over the DP group of ``dims``; a drop-in for torch's DDP.

    Args:
        module: the model replica; its parameters are broadcast from DP rank 0 at wrap time.
        dims: a :class:`distllm.ParallelDims`. With ``dims.dp == 1`` nothing is communicated
            (gradients are left as autograd produced them) — the degenerate, valid case.
        bucket_cap_mb: bucket size in MiB of gradient (first bucket: 1 MiB).
        first_bucket_mb: size of bucket 0, the first to be reduced.
        finish_on_backward_end: when True (default) the end of each synchronised backward
            pass launches the remaining buckets and waits for all, like torch DDP. Set it to
            False when one step's gradients come from several ``autograd.backward`` calls
            (zero-bubble pipelines run the weight-gradient "W" passes separately) and call
            :meth:`finish_grad_sync` after the last of them.
        broadcast_buffers: also broadcast module buffers from DP rank 0, at wrap time and
            before the first forward and each forward that follows a synchronised one
            (grad enabled, outside :meth:`no_sync`: the first of each step), as torch DDP
            does, so that each step starts from rank 0's running statistics (BatchNorm's)
            on every rank. Off for buffers every rank computes alike.
        find_unused_parameters: after each forward, walk the autograd graph from the outputs
            and mark the parameters it does not reach as ready (zeros), so that their buckets
            are reduced during backward instead of at its end; and, as torch DDP does, leave
            ``.grad`` None on a parameter that no rank used in the step (one small all-reduce
            of the use flags, read back at the end of backward), so that an optimizer skips
            it (no weight decay, no moment update). Without it unused parameters are still
            handled (at the end of backward), just without overlap for their bucket, and one
            that no rank used gets zeros.
        overlap_grad_reduce: launch each bucket's all-reduce as soon as it is full, during
            backward (``True``, the default, as torch DDP). ``False``: the same buckets,
            copies and all-reduces, all launched at the end of backward (Megatron-LM's
            ``--overlap-grad-reduce`` off): the reference for what the overlap gains, or to
            rule it out when debugging. ``"auto"``: on CPU a trial in the first steps
            decides (:mod:`distllm.parallel.data.reduction_trial`); on a GPU, overlapped.
            ``reducer.tuning`` is True while the trial runs; ``reducer.overlap_reason``
            says how the buckets reduce and why (the trial's figures once it decided).

    Collectives: forward none; backward one all-reduce per bucket (sum, pre-divided by dp).
    After backward the gradients are views of the buckets (``param.grad`` aliases the flat
    buffer). After ``zero_grad()`` (``set_to_none=True``) the hook writes each new gradient
    into its bucket divided by ``dp`` in one pass and frees autograd's tensor;
    ``zero_grad(set_to_none=False)`` keeps the views, zeroed, for autograd to add into.

    Unused parameters: a parameter that gets no gradient contributes zeros when its bucket
    is launched at the end of backward (or by :meth:`finish_grad_sync`), so no step hangs;
    its ``.grad`` afterwards is the average over the ranks where it was used (None where no
    rank used it, with ``find_unused_parameters``).
    """

    def __init__(self, module: nn.Module, *, dims: ParallelDims, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = FIRST_BUCKET_BYTES / 2**20,
                 finish_on_backward_end: bool = True, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False,
                 overlap_grad_reduce: bool | str = True) -> None:
        super().__init__()
        params = check_module(module)
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(
                f"module has parameters of several dtypes {dtypes}: DDP reduces each bucket in "
                "the parameters' dtype, so cast the model to one (module.to(dtype)), or use "
                "ZeroOptimizer(stage=0, param_dtype=...) for mixed precision with fp32 reduction")
        cap = bucket_bytes("bucket_cap_mb", bucket_cap_mb, 25)
        first = bucket_bytes("first_bucket_mb", first_bucket_mb, FIRST_BUCKET_BYTES / 2**20)
        group = dp_group_of(dims)
        self.reducer: GradBuckets | None = None
        take_over(params, self, "DistributedDataParallel")
        self.module = module
        self.dims = dims
        self.group = group
        # the buffers each synchronised forward takes from DP rank 0
        self._synced_buffers = (list(module.buffers()) if broadcast_buffers and group is not None
                                else [])
        self._sync_buffers_next = True  # (the first forward, then after a synchronised one)
        if group is not None:
            broadcast_from_dp0([*module.parameters(), *self._synced_buffers], dims)
        buckets = assign_buckets(params, cap, first)
        self.find_unused_parameters = find_unused_parameters
        # find_unused_parameters: this step's use flags (1 where a forward reached the
        # parameter, OR-ed over the micro-batches), all-reduced (MAX) from the synchronised one
        self._used: torch.Tensor | None = None
        self._used_work: Any = None
        self._carried: set[torch.nn.Parameter] = set()
        if group is not None:
            self.reducer = GradBuckets(
                buckets, group=group, mode="all_reduce", dtype=params[0].dtype,
                as_view=True, persistent=True,
                finish_on_backward_end=finish_on_backward_end, overlap=overlap_grad_reduce,
                on_finish=self._none_where_unused if find_unused_parameters else None)

    def remove_hooks(self) -> None:
        """Remove the parameters' gradient hooks: a newer wrapper of the same parameters
        calls it (:mod:`distllm.parallel.data.hooks`)."""
        if self.reducer is not None:
            self.reducer.remove_hooks()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._synced_buffers:
            if self._sync_buffers_next:
                broadcast_from_dp0(self._synced_buffers, self.dims)
            self._sync_buffers_next = torch.is_grad_enabled() and self.reducer.sync_enabled
        out = self.module(*args, **kwargs)
        if self.find_unused_parameters and self.reducer is not None and torch.is_grad_enabled():
            used = _reachable_params(out)
            params = list(self.reducer.params())
            # an unused parameter's gradient carried over from before (no zero_grad) stays,
            # as torch DDP leaves it (the last forward's view: an unused parameter's gradient
            # is the same at each micro-batch's, and a forward no backward followed is gone)
            self._carried = {p for p in params if p not in used and p.grad is not None}
            # the flags' all-reduce first: marking a rank's unused parameters may launch a
            # bucket's reduction now, where a rank that uses them launches it in backward
            self._flag_used([p in used for p in params], params[0].device)
            self.reducer.mark_unused(p for p in params if p not in used)
        return out

    def _flag_used(self, flags: list[bool], device: torch.device) -> None:
        """OR this forward's use flags into the step's; the synchronised forward (outside
        ``no_sync``) launches their all-reduce, waited for at the end of backward."""
        mask = torch.tensor(flags, dtype=torch.int32, device=device)
        if self._used_work is not None:  # a forward whose backward never ran: done with it
            self._used_work.wait()
            self._used, self._used_work = None, None
        self._used = mask if self._used is None else self._used.bitwise_or_(mask)
        if self.reducer.sync_enabled:
            self._used_work = all_reduce(self._used, group=self.group, async_op=True,
                                         op=dist.ReduceOp.MAX)

    def _none_where_unused(self) -> None:
        """At the end of a synchronised backward: ``.grad = None`` on the parameters no rank
        used (their bucket slices hold zeros), as torch DDP leaves them; one that held a
        gradient from before keeps it (its slice holds it, averaged)."""
        if self._used_work is None:
            return
        self._used_work.wait()
        flags = self._used.tolist()  # the one host read of the mode, as torch DDP's
        self._used, self._used_work = None, None
        carried, self._carried = self._carried, set()
        for p, used in zip(self.reducer.params(), flags, strict=True):
            if not used and p not in carried:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no reduction, inside the context (for all
        micro-batches but the last one of a gradient-accumulation step). The local sums
        accumulate in the buckets, so ``param.grad`` reads ``None`` until the synchronised
        backward (torch DDP leaves the local sum in ``.grad``)."""
        if self.reducer is None:
            yield
            return
        with self.reducer.no_sync():
            yield

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet (parameters without a gradient count as
        zeros) and wait for all reductions. Idempotent within a step."""
        if self.reducer is not None:
            self.reducer.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients, as ``nn.Module.zero_grad``. ``True`` (the default, torch's
        too) sets each ``.grad`` to ``None``: the next backward hands its gradient over and
        the hook divides it into its bucket slice in one pass. ``False`` zeroes them in place
        (with buckets they stay bucket views that the next backward accumulates into)."""
        if self.reducer is None:
            self.module.zero_grad(set_to_none=set_to_none)
        else:
            self.reducer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over this replica's TP/PP shards (see
        :func:`distllm.parallel.data.grad_norm.clip_grad_norm_`)."""
        self.finish_grad_sync()
        return clip_grad_norm_(self.module.parameters(), max_norm, dims=self.dims,
                               norm_type=norm_type)

    def clip_grad_norm_and_sum_(self, max_norm: float,
                                extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`clip_grad_norm_` (2-norm) with ``extra`` summed over the world in the same
        all-reduce (see :func:`distllm.parallel.data.grad_norm.clip_grad_norm_and_sum_`)."""
        self.finish_grad_sync()
        return clip_grad_norm_and_sum_(self.module.parameters(), max_norm, dims=self.dims,
                                       extra=extra)

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket, bucket 0 (reduced first) first."""
        return [b.numel for b in self.reducer.buckets] if self.reducer else []

    def held_tensors(self) -> dict[str, list[Tensor]]:
        """The tensors this rank holds for training, by kind (``params``, ``grads``), for
        :func:`~distllm.parallel.data.memory.memory_report`."""
        bufs = [b.buffer for b in self.reducer.buckets] if self.reducer is not None else []
        return {"params": list(self.module.parameters()),
                "grads": bufs + [p.grad for p in self.module.parameters()]}


def _reachable_params(out: Any) -> set[torch.Tensor]:
    """Leaf tensors whose AccumulateGrad node is reachable from the tensors in ``out``."""
    from torch.utils._pytree import tree_leaves

    stack = [t.grad_fn for t in tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(var)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found

