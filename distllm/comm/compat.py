"""The one place where torch-version differences are handled.

distllm supports torch 2.11 through 2.14.1. Any torch API newer than 2.11 (or whose
name changed inside that range) is reached through this module, never probed at the
call site. Each choice is made once, when this module is imported.

Collectives on one flat tensor:

- :func:`all_gather_into`: ``torch.distributed.all_gather_single`` where torch has it
  (it replaces the deprecated ``all_gather_into_tensor``), else
  ``all_gather_into_tensor``;
- :func:`reduce_scatter_into`: ``torch.distributed.reduce_scatter_single`` where torch
  has it, else ``reduce_scatter_tensor``.

Both call the torch function as is: a backend that lacks the collective (gloo has no
reduce-scatter) still raises, and callers keep their own workaround for it
(:func:`distllm.comm.collectives.reduce_scatter` exchanges pairwise on gloo).

Launching:

- :func:`elastic_launch_config`: torch's elastic ``LaunchConfig``, with ``shutdown_timeout``
  (how long the agent waits for its workers after passing on a signal, before SIGKILL) where
  torch has the field; older torch (2.11) waits 30 s.
- :func:`elastic_signal_handler`: wraps the handler torch's elastic agent installs for the
  signals it passes on (``_terminate_process_handler``, looked up when it starts the ranks;
  private, present from torch 2.11 to 2.14): the launcher's second Ctrl-C kills the ranks.

Switches:

- :func:`tf32_matmul_allowed`: whether float32 CUDA matmuls may use TF32, read from
  ``torch.backends.cuda.matmul.fp32_precision`` (falling back to the global
  ``torch.backends.fp32_precision``). Reading the legacy ``allow_tf32`` raises once a user
  has set TF32 through the newer API, so nothing in distllm reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

__all__ = ["ALL_GATHER_API", "REDUCE_SCATTER_API", "all_gather_into", "reduce_scatter_into",
           "tf32_matmul_allowed", "elastic_launch_config", "elastic_signal_handler"]


def _pick(module: Any, new: str, old: str) -> tuple[str, Callable[..., Any]]:
    """``(name, function)`` of ``module.<new>`` when it exists, else of ``module.<old>``."""
    fn = getattr(module, new, None)
    if fn is not None:
        return new, fn
    return old, getattr(module, old)


# Name of the torch.distributed function each wrapper calls, for `distllm info` and tests.
ALL_GATHER_API, _all_gather = _pick(dist, "all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_API, _reduce_scatter = _pick(dist, "reduce_scatter_single", "reduce_scatter_tensor")


def all_gather_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """All-gather ``inp`` from every rank of ``group`` into ``out``, in rank order.

    ``out`` holds ``world * inp.numel()`` elements: the ranks' inputs concatenated along
    dim 0 (or stacked). Returns the work handle when ``async_op``, else ``None``.
    """
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Work | None:
    """Reduce ``inp`` (``world * out.numel()`` elements) over ``group`` with ``op``; rank
    ``r`` receives slice ``r`` of the result (along dim 0) in ``out``.

    Returns the work handle when ``async_op``, else ``None``.
    """
    return _reduce_scatter(out, inp, op=op, group=group, async_op=async_op)


def tf32_matmul_allowed() -> bool:
    """Whether float32 CUDA matmuls may use TF32: torch's matmul switch, set either way
    (``allow_tf32 = True`` reads as ``fp32_precision == "tf32"``). "none" defers to the
    global ``torch.backends.fp32_precision``; both "none" is torch's default, IEEE."""
    precision = torch.backends.cuda.matmul.fp32_precision
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision == "tf32"


def elastic_launch_config(*, shutdown_timeout: int, **kw: Any) -> Any:
    """``torch.distributed.launcher.api.LaunchConfig(**kw)``, with ``shutdown_timeout`` (whole
    seconds) where torch's ``LaunchConfig`` has the field, else dropped. (Asked here, not at
    import: the launcher's modules take 17 ms to import, which a rank never needs.)"""
    from dataclasses import fields

    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)}:
        kw["shutdown_timeout"] = shutdown_timeout
    return LaunchConfig(**kw)


@contextlib.contextmanager
def elastic_signal_handler(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, the elastic agent installs ``wrap(handler)`` instead of its own
    handler (which raises ``SignalException``) for the signals it passes on to its ranks.
    Where torch lacks that private function, nothing is wrapped: torch's own runs."""
    from torch.distributed.elastic.multiprocessing import api

    real = getattr(api, "_terminate_process_handler", None)
    if real is None:
        yield
        return
    api._terminate_process_handler = wrap(real)
    try:
        yield
    finally:
        api._terminate_process_handler = real
