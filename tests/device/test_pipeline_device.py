"""The pipeline executor on a (fake) CUDA job: the communicator start-up all-reduces, the
activation headers and activations sent between stages, and the loss broadcast all use CUDA
tensors; the loss is read back once per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.parallel.pipeline import PipelineParallel
from tests.device._fakecuda import CUDA, CudaDims, fake_world

MB, B, H = 2, 4, 8  # micro-batches, batch, width


def _header(t: torch.Tensor):
    """The activation header a first stage sends: ``[ndim, dtype code, dims..., 0...]``."""
    if t.dtype == torch.int64 and t.numel() == 10:
        return [2, 0, B // MB, H] + [0] * 6
    return 0.0


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).pow(2).mean()


@pytest.mark.parametrize("channels", [False, True], ids=["one-group", "p2p-channels"])
@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
def test_pipeline_step_on_cuda(cuda_job, rank, channels):
    rec, host = cuda_job
    host.value = _header
    with fake_world(2, rank=rank):
        dims = CudaDims(tp=1, pp=2, dp=1)
        layers = [nn.Linear(H, H, device=CUDA) for _ in range(4)]
        pipe = PipelineParallel(layers, dims, schedule="1f1b", micro_batches=MB,
                                p2p_channels=channels)
        x = torch.randn(B, H, device=CUDA)
        y = torch.randn(B, H, device=CUDA)
        loss = pipe.eval_step(x if rank == 0 else None, y if rank == 1 else None, _mse)
    assert isinstance(loss, float)
    reads = [how for how, _ in host.syncs]
    headers = MB if rank == 1 else 0  # forward-only: every activation carries its header
    assert reads.count("tolist") == headers and len(reads) == headers + 1, host.syncs
    p2p = {"batch_isend_irecv", "isend"} if rank == 0 else {"batch_isend_irecv", "irecv"}
    rec.check(expect={"all_reduce", "broadcast"} | p2p)
