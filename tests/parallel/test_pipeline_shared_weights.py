"""zb-h1 with a weight used more than once in a stage: a layer called twice (both calls'
weight GEMMs deferred) and a weight also read by an op whose gradient B computes. W sums a
parameter's parts and accumulates it once, so its post-accumulate hook fires once per
micro-batch, as in a plain backward: with one hook per part, the data-parallel bucket of
the last micro-batch launched its reduction and the next part raised (pp2 x dp2, DDP with
overlapped reduction). Gradients equal 1F1B's, which the parity tests hold to float64.
Also: tensors a stage reads without holding them as parameters get their gradient under
zb-h1 as under 1F1B, and a weight shared by layers on two pipeline ranks is refused."""

from __future__ import annotations

import torch
from torch import nn

from distllm.testing import run_distributed
from tests._errors import worst


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
            assert worst(float((g1[n] - gz[n]).abs().max()) for n in g1) < 1e-12


def _outside(schedule):
    """pp2, m2: the last stage's loss reads a learnable temperature, the first stage a scale
    that a layer holds outside its parameters: neither is a parameter of a stage."""
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=2, dp=1)
    tau = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    class _Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * scale

    torch.manual_seed(0)
    layers = [_Scaled(8, 8, dtype=torch.float64), nn.Linear(8, 8, dtype=torch.float64)]
    pipe = PipelineParallel(layers, dims, schedule=schedule, micro_batches=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    t = torch.randn(4, 8, dtype=torch.float64, generator=g)
    pipe.train_step(x, t, lambda y, tt: ((y * tau - tt) ** 2).mean())
    mine = tau.grad if dims.pp_rank == 1 else scale.grad
    return None if mine is None else float(mine)


def test_zb_h1_gives_tensors_outside_the_stages_parameters_their_gradient():
    """A tensor that requires grad and that a stage reads without holding it as a parameter
    (a learnable temperature in ``loss_fn``, a scale a layer closes over) gets the same
    gradient under zb-h1's split backward as under 1F1B's plain one."""
    ref = run_distributed(_outside, 2, "1f1b", timeout=120)
    got = run_distributed(_outside, 2, "zb-h1", timeout=120)
    assert None not in ref, ref
    assert all(g is not None and abs(g - r) < 1e-12 for g, r in zip(got, ref, strict=True)), \
        (got, ref)


class _TiedHead(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, x):
        return x @ self.emb.weight.T


def _tied():
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=2, dp=1)
    emb = nn.Linear(8, 8, dtype=torch.float64)
    try:
        PipelineParallel([emb, nn.Linear(8, 8, dtype=torch.float64), _TiedHead(emb)], dims,
                         layers_per_stage=[2, 1])
    except ValueError as e:
        return str(e)
    return None


def test_a_weight_shared_by_layers_on_two_pipeline_ranks_is_refused():
    """A weight tied between a first-stage and a last-stage layer would get each rank's part
    of its gradient only: refused at construction, on every rank, naming both layers."""
    for msg in run_distributed(_tied, 2, timeout=120):
        assert msg is not None and "layers 0 (weight) and 2 (emb.weight)" in msg, msg
