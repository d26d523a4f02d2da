"""zb-h1 with a weight used more than once in a stage: a layer called twice (both calls'
weight GEMMs deferred) and a weight also read by an op whose gradient B computes. W sums a
parameter's parts and accumulates it once, so its post-accumulate hook fires once per
micro-batch, as in a plain backward: with one hook per part, the data-parallel bucket of
the last micro-batch launched its reduction and the next part raised (pp2 x dp2, DDP with
overlapped reduction). Gradients equal 1F1B's, which the parity tests hold to float64."""

from __future__ import annotations

import torch
from torch import nn

from distllm.testing import run_distributed


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x):
        # the weight's third use: not a linear, so B computes that part
        return self.lin(torch.tanh(self.lin(x))) + 0.1 * self.lin.weight.sum(0)


def _both(bucket_cap_mb):
    from distllm import ParallelDims
    from distllm.parallel.data import DistributedDataParallel
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=2, dp=2)
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8, dtype=torch.float64), _Twice(), _Twice(),
                  nn.Linear(8, 8, dtype=torch.float64)]
        pipe = PipelineParallel(layers, dims, schedule=schedule, micro_batches=2)
        fired = []
        for p in pipe.parameters():
            p.register_post_accumulate_grad_hook(lambda p, fired=fired: fired.append(p))
        pipe.grad_sync = DistributedDataParallel(
            pipe.chunks, dims=dims, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb,
            finish_on_backward_end=not pipe.schedule.split_backward, overlap_grad_reduce=True)
        g = torch.Generator().manual_seed(1 + dims.dp_rank)
        x = torch.randn(4, 8, dtype=torch.float64, generator=g)
        t = torch.randn(4, 8, dtype=torch.float64, generator=g)
        loss = pipe.train_step(x, t, lambda y, tt: ((y - tt) ** 2).mean())
        out[schedule] = (loss, {n: p.grad.clone() for n, p in pipe.global_named_parameters()},
                         len(fired), sum(1 for _ in pipe.parameters()))
    return out


def test_a_weight_used_several_times_in_a_stage_fires_its_hook_once_per_micro_batch():
    for bucket_cap_mb in (0.0001, 25.0):
        for r in run_distributed(_both, 4, bucket_cap_mb, timeout=120):
            (l1, g1, n1, params), (lz, gz, nz, _) = r["1f1b"], r["zb-h1"]
            assert n1 == nz == 2 * params, (n1, nz, params)  # once per micro-batch each
            assert abs(l1 - lz) < 1e-12
            assert max(float((g1[n] - gz[n]).abs().max()) for n in g1) < 1e-12
