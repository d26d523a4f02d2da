"""Pipeline executor with CUDA tensors (one rank: every schedule's stages local, chunks passed
through the in-process mailbox; zb-h1's deferred weight gradients on the GPU), float64 vs
the same model on one process. Multi-rank NCCL point-to-point needs two GPUs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.testing import run_distributed
from tests._errors import worst

pytestmark = pytest.mark.gpu


def _cuda_parity(cases, device: str = "cuda"):
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=1, dp=1)
    dev = torch.device(device)
    errs = []
    for schedule, m, v in cases:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32),
                                nn.Linear(32, 16)) for _ in range(4)]
        layers = [layer.double().to(dev) for layer in layers]
        ref = nn.Sequential(*layers)  # the same modules, run on one process
        x = torch.randn(4 * m, 7, 16, dtype=torch.float64, device=dev)
        y = torch.randn_like(x)

        def loss_fn(out, t):
            return (out - t).pow(2).mean()

        ref_loss = loss_fn(ref(x), y)
        ref_grads = torch.autograd.grad(ref_loss, list(ref.parameters()))
        pp = PipelineParallel(layers, dims, schedule, m, v)
        loss = pp.train_step(x, y, loss_fn)
        err = abs(loss - ref_loss.item())
        for p, g in zip(pp.parameters(), ref_grads, strict=True):
            err = worst(err, float((p.grad - g).abs().max()))
        errs.append(err)
    return errs


def test_pipeline_cuda_tensors():
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA (run through bench/gpu_check.sh)")
    cases = [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 2, 2), ("zb-h1", 3, 1)]
    errs = run_distributed(_cuda_parity, 1, cases, timeout=300)[0]
    assert worst(errs) < 1e-10, dict(zip([c[0] for c in cases], errs, strict=True))
