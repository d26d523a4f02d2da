"""A 1-rank NCCL world for the GPU tests: :func:`run_nccl` runs ``fn`` in a fresh process
(through :func:`distllm.testing.run_distributed`, which starts a gloo world) that replaces
the gloo world by an NCCL one on ``cuda:0``, so that every collective the code under test
issues goes through NCCL, which refuses CPU tensors. Imports nothing from CUDA at import
time (the test modules must collect on a CPU-only machine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distllm.testing import run_distributed


def _in_nccl_world(fn: Callable[..., Any], *args: Any) -> Any:
    import torch
    import torch.distributed as dist

    dist.destroy_process_group()  # the gloo world run_distributed started
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    assert dist.get_backend() == "nccl"
    return fn(*args)


def run_nccl(
    fn: Callable[..., Any], *args: Any, timeout: float = 100.0, env: dict[str, str] | None = None
) -> Any:
    """``fn(*args)`` in a fresh process whose default process group is a 1-rank NCCL world.
    ``timeout`` stays under bench/gpu_check.sh's 120 s a test, so that a slow child ends with
    this harness's message (and the child killed) rather than pytest-timeout's."""
    return run_distributed(_in_nccl_world, 1, fn, *args, timeout=timeout, env=env)[0]
