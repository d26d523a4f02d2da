"""Test setup: Triton runs through its interpreter where no GPU is present; tests marked
``gpu`` need CUDA and are deselected by ``make test`` (bench/gpu_check.sh runs them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The source tree's top-level ``kernels/`` (installed as ``distllm.kernels``) is importable as
# ``kernels`` while the tree's root is on ``sys.path`` ahead of site-packages (``python -m
# pytest`` and pytest's rootdir insertion put it first), and then it shadows the ``kernels``
# distribution that transformers >= 5 imports. The root goes last: ``tests`` (found only here)
# still imports from it, and a top-level ``kernels`` is the installed one where there is one.
_ROOT = Path(__file__).resolve().parent.parent
_here = [p for p in sys.path if p in ("", ".") or Path(p).resolve() == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _here] + _here

# Must be set before triton is first imported (anywhere) in this process.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available() or config.getoption("collectonly"):
        return  # listing the gpu tests (--collect-only) needs no GPU
    gpu = [it for it in items if it.get_closest_marker("gpu")]
    if gpu and "not gpu" not in (config.getoption("-m") or ""):
        msg = (f"{len(gpu)} tests are marked gpu but no CUDA device is visible: run with "
               "-m 'not gpu' (as `make test` does) or on a GPU (bench/gpu_check.sh)")
        if hasattr(config, "workerinput"):  # an xdist worker: its error would not be shown
            print(f"ERROR: {msg}", file=sys.__stderr__, flush=True)
        raise pytest.UsageError(msg)


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """A test that starts a ``torch.distributed`` world in the pytest process (a
    ``ParallelDims()`` outside a launched job starts a 1-rank one) ends it, so that what a
    later test finds does not depend on the order the tests run in (a dry run, for one,
    refuses to start inside a world)."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
