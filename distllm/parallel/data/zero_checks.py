"""The gradient checks of :class:`~distllm.parallel.data.zero.ZeroOptimizer`: the global
norm over DP shards, TP and PP (and clipping by it), the inf/NaN flag every rank agrees on,
and both in one all-reduce with the loss (what a training step reads back once).

A mixin: it reads the optimizer's ``masters`` (with their reduced ``grad``), ``reducer``
(the gradient buckets), ``stage``, ``nranks``, ``dims``, ``shard_range`` and
``_prepare_grads``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from distllm.parallel.data.grad_norm import (
    all_finite,
    clip_by,
    global_norm,
    is_tp_sharded,
    local_norm,
    norm_and_sums,
)

__all__ = ["ZeroGradChecks"]


class ZeroGradChecks:
    """Norm, clipping and inf/NaN checks over a ZeRO optimizer's reduced gradient shards."""

    # --- clipping -------------------------------------------------------------------------
    def _tp_pieces(self) -> Iterator[tuple[Tensor, bool]]:
        """``(grad slice, tp_sharded)`` for every run of this rank's shards; without TP every
        element counts, so each shard is one piece (its padding holds zeros)."""
        if self.dims.tp == 1:
            for m in self.masters:
                if m.grad is not None:
                    yield m.grad, True
            return
        for i, m in enumerate(self.masters):
            b = self.reducer.buckets[i]
            lo, hi = self.shard_range(b.numel)
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
                a, e = max(off, lo), min(off + shape.numel(), hi)
                if a < e:
                    yield m.grad[a - lo: e - lo], is_tp_sharded(p)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the global gradient norm (over DP shards, TP and PP) to ``max_norm`` and
        return the norm before clipping. Collective: one all-reduce over the world group
        (stages 1-3) or the model-parallel group (stage 0)."""
        self._prepare_grads()
        norm = global_norm(self._tp_pieces(), dims=self.dims, norm_type=norm_type,
                           dp_sharded=self.stage >= 1 and self.nranks > 1)
        clip_by(norm, max_norm, self._clip_targets())
        return norm

    def _clip_targets(self) -> list[Tensor]:
        """The gradients clipping scales, each storage once: the masters' gradients and, at
        stages 0-1, the whole replicated bucket of each (not only this rank's slice), so
        that the ``.grad`` views read clipped and the buckets stay equal on every DP rank; a
        gradient accumulated into them without ``zero_grad`` is then averaged onto the
        same clipped values everywhere, as with torch's DDP."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        if self.stage >= 2:
            return grads
        bufs = [b.buffer for b in self.reducer.buckets if b.buffer is not None]
        ptrs = {b.untyped_storage().data_ptr() for b in bufs}
        return bufs + [g for g in grads if g.untyped_storage().data_ptr() not in ptrs]

    @torch.no_grad()
    def clip_and_check(self, max_norm: float, extra: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`clip_grad_norm_` (2-norm) and :meth:`found_inf` with one all-reduce over the
        world group instead of two, also summing ``extra`` (float64, this rank's values, e.g.
        its share of the loss) over the world in it. Returns ``(norm, found_inf, extra
        summed)`` (float64, float32, float64; on the device, no host sync). At stage 0 or
        with one DP rank (whose norm is reduced over another group) it makes the calls
        separately."""
        world = self.dims.world_group
        if not (self.stage >= 1 and self.nranks > 1):
            norm = self.clip_grad_norm_(max_norm)
            flag = self.found_inf()
            if extra is not None and dist.get_world_size(world) > 1:
                extra = extra.clone()
                dist.all_reduce(extra, group=world)
            return norm, flag, extra
        self._prepare_grads()
        # the squares, the inf/NaN flags (summed: any rank's) and extra, in one all-reduce
        norm, sums = norm_and_sums(local_norm(self._tp_pieces(), dims=self.dims),
                                   [self._local_inf()] + ([extra] if extra is not None else []),
                                   world)
        clip_by(norm, max_norm, self._clip_targets())
        return norm, (sums[0] > 0).to(torch.float32), sums[1:] if extra is not None else None

    @torch.no_grad()
    def found_inf(self) -> Tensor:
        """1.0 if a gradient of any rank holds inf/NaN, else 0.0: a float32 scalar on the
        parameters' device, the same on every rank (the gradient sync is finished first).
        Collective: one all-reduce (MAX) over the world group; no host sync."""
        self._prepare_grads()
        flag = self._local_inf()
        if dist.get_world_size(self.dims.world_group) > 1:  # every rank skips together
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dims.world_group)
        return flag

    def _local_inf(self) -> Tensor:
        """1.0 if a gradient shard of this rank holds inf/NaN, else 0.0 (float32 scalar)."""
        grads = [m.grad for m in self.masters if m.grad is not None and m.grad.numel()]
        if grads:
            return (~torch.stack([all_finite(g) for g in grads]).all()).to(torch.float32)
        dev = self.masters[0].device if self.masters else self.dims.device
        return torch.zeros((), dtype=torch.float32, device=dev)
