"""Batch-split overlap: the row-parallel all-reduce of one part of the batch hides behind
the next part's compute.

A tensor-parallel transformer's residual stream ``x = x + f(x)`` (``f`` the attention or
the MLP) ends every ``f`` with the all-reduce of its row-parallel output, and the next ``f``
needs that sum: a chunked GEMM (:mod:`distllm.parallel.tensor.overlap`) can only hide it
behind the rest of the same GEMM. Splitting the batch into ``parts`` independent pieces
(rows of different sequences never meet inside a layer) gives each all-reduce the next
piece's whole sublayer to hide behind instead: with two parts, ``f(x_0)``'s all-reduce runs
while ``f(x_1)`` computes, and ``f(x_1)``'s while the stream of ``x_0`` goes on::

    compute:  f(x_0)  f(x_1)     g(x_0)     g(x_1)     ...
    comm:             AR(f x_0)  AR(f x_1)  AR(g x_0)  AR(g x_1)

The idea is Domino's (Wang et al., "Domino: Eliminating Communication in LLM Training via
Generic Tensor Slicing and Overlapping", 2024, arXiv:2409.15241), batch dimension only. Each
row's arithmetic is unchanged (every GEMM, norm and attention acts on rows of one sequence),
so the result is the unsplit one up to the GEMM's blocking. Backward is autograd's, part by
part; its all-reduces (the column-parallel input gradients) overlap the weight-gradient
GEMMs as before.

What it costs: each part's backward computes that part's weight gradients (GEMMs over half
the rows, each as large as the weight) and autograd adds them, a pass over every weight
gradient that the unsplit step does not make. Measured on 2 CPU ranks (tp2, the 6x768
model of ``distllm bench --suite train_e2e``, 512 tokens a step, interleaved medians of 8
repetitions), the forward alone ran in 301 against 342 ms over an emulated 2 Gbit/s link and
299 against 290 ms on loopback, but a training step took 949 against 931 ms and 998
against 942 ms. So ``GPT(batch_split="auto")`` splits only a forward that no backward
follows (evaluation, inference), on CPU.

Mechanics: inside :func:`defer_reductions` a row-parallel layer (``RowParallelLinear``, the
fused ``ParallelMLP``'s ``fc2``) computes its whole GEMM, launches the all-reduce and
returns the partial sum at once (:meth:`OverlapPlan.launch_deferred`), its bias not yet
added; :meth:`DeferredReductions.finish` waits and returns the sum plus the bias. Nothing
may read the partial sum before that: a sublayer must return its one row-parallel output
unchanged, and any other output is refused (:meth:`DeferredReductions.check`).
:func:`split_residual` runs a stack of sublayers that way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["DeferredReductions", "defer_reductions", "deferring", "with_bias",
           "split_residual", "split_parts"]

_STATE = threading.local()


class DeferredReductions:
    """The all-reduces a sublayer launched and left in flight, and the biases to add after."""

    def __init__(self) -> None:
        self._pending: list[tuple[object, object, torch.Tensor]] = []  # (plan, handle, out)
        self._versions: list[int] = []  # each ``out``'s version when its all-reduce launched
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(out): (out, bias)

    def launched(self, plan, handle, out: torch.Tensor) -> None:
        """Record ``plan``'s all-reduce ``handle`` of the partial sum ``out`` (waited for by
        :meth:`finish`)."""
        self._pending.append((plan, handle, out))
        self._versions.append(out._version)  # the sum lands without bumping it

    def add_bias_later(self, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Have :meth:`finish` return ``out + bias`` for ``out`` (a replicated bias goes on
        the reduced sum, once)."""
        if bias is not None:
            self._bias[id(out)] = (out, bias)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def check(self, out: torch.Tensor) -> None:
        """RuntimeError unless ``out`` is the one partial sum launched (or none was): the
        sublayer must return its row-parallel layer's output itself, since anything computed
        from a partial sum before its all-reduce finished is wrong."""
        launched = [o for _, _, o in self._pending]
        changed = [o for o, v in zip(launched, self._versions, strict=True) if o._version != v]
        if changed:
            raise RuntimeError(
                "batch split: a sublayer changed its row-parallel layer's output in place "
                "while that partial sum's all-reduce was in flight (e.g. y.mul_(2) after the "
                "row-parallel layer); make it out of place, or run the block unsplit "
                "(split_residual parts=1, GPT batch_split=1)")
        if launched and (len(launched) != 1 or not _same(launched[0], out)):
            got = "another tensor" if len(launched) == 1 else "a tensor"
            raise RuntimeError(
                "batch split: a sublayer must return its one row-parallel layer's output "
                f"unchanged, but it launched {len(launched)} deferred all-reduce(s) and "
                f"returned {got}, computed from a partial sum before its all-reduce (e.g. "
                "the sum of a parallel attention + MLP block, or an op after the "
                "row-parallel layer); run such a block unsplit (split_residual parts=1, "
                "GPT batch_split=1)")

    def drain(self) -> None:
        """Wait for every recorded all-reduce (every rank must, before its next collective)."""
        with torch.no_grad():  # the sum lands in ``out`` in place, outside autograd's view
            for plan, handle, _ in self._pending:
                plan.wait_deferred(handle)
        self._pending, self._versions = [], []

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """Wait for every recorded all-reduce and return ``out`` (now the sum over the TP
        group) plus its bias, if one was recorded for it; :meth:`check`'s RuntimeError (after
        the waits, on every rank alike) if ``out`` is not the partial sum launched."""
        key = self._pending[0][2] if self._pending else out  # (``out`` may alias it)
        try:
            self.check(out)
        finally:
            self.drain()
        hit = self._bias.pop(id(key), None)  # (the dict holds ``key``: its id is its own)
        return out if hit is None else out + hit[1]


def _same(launched: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` is ``launched`` itself, or the same elements under another tensor object (a
    module's full backward hook returns its output through an identity autograd Function,
    as a view of it)."""
    return out is launched or (out._base is launched and out.shape == launched.shape
                               and out.stride() == launched.stride()
                               and out.storage_offset() == launched.storage_offset())


def deferring() -> DeferredReductions | None:
    """The :class:`DeferredReductions` of the innermost :func:`defer_reductions`, if any."""
    return getattr(_STATE, "current", None)


@contextlib.contextmanager
def defer_reductions() -> Iterator[DeferredReductions]:
    """Inside the context, row-parallel forwards (without sequence parallelism) launch their
    all-reduce and return the partial sum; call ``finish(out)`` on the yielded object before
    reading ``out``."""
    prev = deferring()
    d = DeferredReductions()
    _STATE.current = d
    try:
        yield d
    finally:
        _STATE.current = prev


def with_bias(deferred: DeferredReductions | None,
              call: Callable[[torch.Tensor | None], torch.Tensor],
              bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel layer's forward ``call(bias)``; inside a deferral (``deferred`` not
    None) ``call(None)``, with ``bias`` added by ``deferred.finish`` on the sum."""
    if deferred is None:
        return call(bias)
    out = call(None)
    deferred.add_bias_later(out, bias)
    return out


def split_parts(batch: int, parts: int) -> int:
    """The pieces a batch of ``batch`` sequences is cut into: ``parts``, at most ``batch``."""
    return max(1, min(parts, batch))


def split_residual(sublayers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                   x: torch.Tensor, parts: int) -> torch.Tensor:
    """``for f in sublayers: x = x + f(x)`` with ``x`` cut into ``parts`` pieces along dim 0,
    each ``f``'s row-parallel all-reduce deferred until that piece needs it next (see the
    module docstring). Returns the pieces joined again."""
    n = split_parts(x.shape[0], parts)
    if n == 1:
        for f in sublayers:
            x = x + f(x)
        return x
    xs = list(x.tensor_split(n, dim=0))
    waits: list[tuple[DeferredReductions, torch.Tensor] | None] = [None] * n
    live: list[DeferredReductions] = []  # drained on an error: no all-reduce left in flight
    try:
        for f in sublayers:
            for i in range(n):
                if waits[i] is not None:
                    d, out = waits[i]
                    xs[i] = xs[i] + d.finish(out)
                with defer_reductions() as d:
                    live.append(d)
                    out = f(xs[i])
                d.check(out)
                waits[i] = (d, out) if d.pending else None
                if waits[i] is None:  # nothing deferred (e.g. tp=1): the sum is ready
                    xs[i] = xs[i] + d.finish(out)
        for i in range(n):
            if waits[i] is not None:
                d, out = waits[i]
                xs[i] = xs[i] + d.finish(out)
    except BaseException:
        for d in live:
            d.drain()
        raise
    return torch.cat(xs, dim=0)
