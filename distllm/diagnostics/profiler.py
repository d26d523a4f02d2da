"""The one way distllm starts ``torch.profiler``: with kineto's log quiet on a machine
without CUDA.

Kineto (the profiler's backend) prints a ``profiler_start``/``profiler_stop`` line for every
profile, and, building the trace, asks CUDA for its devices even when it profiles the CPU
alone: ``gpuGetDeviceCount failed`` comes out as an error. It reads ``KINETO_LOG_LEVEL``
when a process first profiles, so :func:`quiet_kineto` sets it (above every severity) for
this process and the ranks it starts, before that; a level the user set is kept, and so is
kineto's log where CUDA is.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["profile", "quiet_kineto"]


def quiet_kineto() -> None:
    """Set ``KINETO_LOG_LEVEL=99`` in this process's environment, unless the user set it or
    CUDA is available."""
    if "KINETO_LOG_LEVEL" not in os.environ and not torch.cuda.is_available():
        os.environ["KINETO_LOG_LEVEL"] = "99"


def profile(**kw: Any) -> torch.profiler.profile:
    """``torch.profiler.profile(**kw)``, after :func:`quiet_kineto`."""
    quiet_kineto()
    return torch.profiler.profile(**kw)
