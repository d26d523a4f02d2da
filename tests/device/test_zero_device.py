"""ZeRO-0/1/2/3 steps on a (fake) CUDA job: gradient buckets, their reductions, clipping, the
inf/NaN flag with loss scaling and the parameter all-gathers all run on the device, and a
step reads the device from the host once (the inf/NaN decision)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.comm.compat import ALL_GATHER_API, REDUCE_SCATTER_API
from distllm.parallel import ZeroOptimizer
from tests.device._fakecuda import CUDA, CudaDims, emulate_backward, fake_world

AG, RS = ALL_GATHER_API, REDUCE_SCATTER_API  # torch's names for them, as compat picks
EXPECT = {0: {"all_reduce"}, 1: {"all_reduce", AG}, 2: {"all_reduce", AG, RS},
          3: {"all_reduce", AG, RS}}


class Net(nn.Module):
    """Odd sizes (so buckets are padded), two layers in a ModuleList (ZeRO-3 units)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13, device=CUDA)
        self.blocks = nn.ModuleList(nn.Linear(13, 13, device=CUDA) for _ in range(2))
        self.head = nn.Linear(13, 5, device=CUDA)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.nn.functional.gelu(b(x))
        return self.head(x)


def _backward(monkeypatch, z: ZeroOptimizer, model: Net) -> None:
    """Gradients for every parameter, last layer first; ZeRO-3 gathers each unit first (as
    the hook on its outputs does when backward reaches it; ``inp`` and ``head`` form the
    root unit, gathered when backward starts)."""
    steps: list = []
    for u, gathered in [(model.head, model), *((b, b) for b in reversed(model.blocks)),
                        (model.inp, None)]:
        if z.sharded is not None and gathered is not None:
            steps.append(lambda m=gathered: z.sharded._pre_backward(m))
        steps += [(p, None) for p in reversed(list(u.parameters()))]
    emulate_backward(monkeypatch, steps)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-dynamic-scale"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_step_on_cuda(cuda_job, monkeypatch, stage, mixed):
    rec, host = cuda_job
    with fake_world(2):
        dims = CudaDims(tp=1, pp=1, dp=2)
        model = Net()
        kw = dict(param_dtype=torch.bfloat16, loss_scale="dynamic") if mixed else {}
        z = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, lr=0.1,
                          momentum=0.9, bucket_cap_mb=0.0005, **kw)
        for _ in range(2):
            x = torch.randn(4, 3, 7, device=CUDA, dtype=z.param_dtype)
            assert z.scale_loss(model(x).float().pow(2).mean()).device == CUDA
            _backward(monkeypatch, z, model)
            before = len(host.syncs)
            norm = z.clip_grad_norm_(1.0)
            assert norm.device == CUDA and len(host.syncs) == before, host.syncs[before:]
            assert z.step() is True
            assert len(host.syncs) == before + 1, f"one host read per step: {host.syncs[before:]}"
            z.zero_grad()
        assert all(m.device == CUDA for m in z.masters)
        for st in z.optimizer.state.values():
            assert all(v.device == CUDA for v in st.values() if isinstance(v, torch.Tensor))
    rec.check(expect=EXPECT[stage])


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_skips_a_non_finite_step_on_cuda(cuda_job, monkeypatch, stage):
    """The host reads one flag; when it says inf/NaN the step is skipped and the scale
    halves, with no other read."""
    rec, host = cuda_job
    host.value = lambda t: 1.0
    with fake_world(2):
        dims = CudaDims(tp=1, pp=1, dp=2)
        model = Net()
        z = ZeroOptimizer(model, torch.optim.SGD, stage=stage, dims=dims, lr=0.1,
                          param_dtype=torch.bfloat16, loss_scale="dynamic")
        model(torch.randn(4, 7, device=CUDA, dtype=torch.bfloat16))
        _backward(monkeypatch, z, model)
        scale = z.loss_scale
        assert z.step() is False
    assert z.skipped_steps == 1 and z.loss_scale == scale / 2
    assert [how for how, _ in host.syncs] == ["item"], host.syncs
    rec.check(expect={"all_reduce"})
