"""``CUDA_DEVICE_MAX_CONNECTIONS`` advice for the overlap engines on Hopper and newer GPUs.

The overlap engines issue each chunk's collective on a communication stream while the next
chunk's GEMM is issued on the compute stream. With several hardware work queues (CUDA's
default is 8 connections) the GPU may start the GEMM, which fills every SM, ahead of the
collective kernel issued before it, and the collective then waits for the GEMM: the overlap
silently does not happen. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` funnels every stream through one
queue, so kernels reach the SMs in issue order (Megatron-LM asks for the same setting when it
overlaps tensor-parallel communication). The check applies from compute capability 9.0.

The library never sets environment variables: it warns once per process, naming the
variable, when an engine is asked to overlap on such a GPU without it. The variable must be
set before the process first touches CUDA (in the launcher's environment).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

__all__ = ["VARIABLE", "max_connections_advice", "warn_max_connections"]

log = logging.getLogger("distllm")

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
_checked: set[str] = set()  # device types/indices already checked (the advice is per process)


def max_connections_advice(capability: tuple[int, int], environ: Mapping[str, str]) -> str | None:
    """The warning for a GPU of ``capability`` under ``environ``, or None when none is due."""
    if tuple(capability) < (9, 0):
        return None
    value = environ.get(VARIABLE)
    if value is not None and value.strip() == "1":
        return None
    now = "unset" if value is None else f"{value!r}"
    return (
        f"overlap on a compute capability {capability[0]}.{capability[1]} GPU with "
        f"{VARIABLE} {now}: the GPU may run a chunk's GEMM ahead of the collective issued "
        f"before it, and the overlap does not happen; set {VARIABLE}=1 in the launcher's "
        "environment (before CUDA starts)"
    )


def warn_max_connections(
    device: torch.device,
    capability: tuple[int, int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Warn once per process (through ``logging.getLogger("distllm")``) when overlapping on
    ``device`` needs ``CUDA_DEVICE_MAX_CONNECTIONS=1``; returns whether it warned now.

    ``capability`` and ``environ`` default to the device's and ``os.environ`` (tests inject
    them). Each device is checked once, so the engines' hot path pays a set lookup."""
    key = str(device)
    if key in _checked:
        return False
    _checked.add(key)
    if "warned" in _checked:
        return False
    cap = capability if capability is not None else torch.cuda.get_device_capability(device)
    msg = max_connections_advice(cap, os.environ if environ is None else environ)
    if msg is None:
        return False
    _checked.add("warned")
    log.warning(msg)
    return True


def reset() -> None:
    """Forget the checks made (for tests)."""
    _checked.clear()
