"""``overlap="auto"`` (every parallel layer's default) on a (fake) CUDA job: the auto-tuner's
MAX all-reduce of its timings, and the overlap engines' collectives, get CUDA tensors; its
timer waits for the layer's own GPU."""

from __future__ import annotations

import pytest
import torch

from distllm.nn.parallel_linear import ColumnParallelLinear, RowParallelLinear
from distllm.parallel.tensor import overlap_tuner
from tests.device._fakecuda import CUDA, CudaDims, fake_world

# the auto-tuner reduces its timings (MAX over ranks) and reads them back through here
TIMING = "diagnostics/timing.py"


@pytest.mark.parametrize("layer", ["row", "row-sp", "column-sp"])
def test_auto_overlap_measures_on_cuda(cuda_job, monkeypatch, layer):
    rec, host = cuda_job
    # the timer waits for the layer's own GPU (a bare synchronize() waits for the current
    # device, cuda:0 where a rank never set its own: it would time launches, not kernels)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    sp = layer.endswith("-sp")
    with fake_world(2):
        dims = CudaDims(tp=2, pp=1, dp=1)
        if layer.startswith("row"):
            m = RowParallelLinear(24, 16, dims, sequence_parallel=sp, overlap="auto",
                                  device=CUDA)
            x = torch.randn(3, 8, 12, device=CUDA)  # (b, s, in/tp)
        else:
            m = ColumnParallelLinear(16, 24, dims, sequence_parallel=True, overlap="auto",
                                     device=CUDA)
            x = torch.randn(3, 4, 16, device=CUDA)  # (b, s/tp, in)
        y = m(x)
    assert y.device == CUDA
    assert synced and set(synced) == {CUDA}, synced
    tuned = [c for c in rec.calls if c.where.startswith(TIMING)]
    assert tuned and all(c.name == "all_reduce" for c in tuned), rec.calls
    # the measurement (once per shape) reads the reduced timings back once
    assert [(how, where.split(":")[0]) for how, where in host.syncs] == [
        ("tolist", TIMING)], host.syncs
    rec.check(expect={"all_reduce"})
    assert len(overlap_tuner._CACHE) == 1
