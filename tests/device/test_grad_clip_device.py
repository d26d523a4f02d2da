"""Gradient clipping on a (fake) CUDA job: the global norm is accumulated and all-reduced on
the device, and clipping needs no host sync; on CPU, the on-device clip coefficient
matches torch's and a non-finite norm leaves the gradients untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.parallel.data.grad_norm import clip_by, clip_grad_norm_, global_norm
from tests.device._fakecuda import CUDA, CudaDims, fake_world


def _params(tp_sharded: bool) -> list[nn.Parameter]:
    ps = [nn.Parameter(torch.randn(7, 5, device=CUDA)), nn.Parameter(torch.randn(3, device=CUDA))]
    ps[0].tensor_model_parallel = tp_sharded
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("layout", ["tp2.dp2", "pp2.tp2"])
def test_clip_grad_norm_on_cuda(cuda_job, layout, norm_type):
    rec, host = cuda_job
    tp = 2
    pp = 2 if layout.startswith("pp") else 1
    with fake_world(4):
        dims = CudaDims(tp=tp, pp=pp, dp=-1)
        ps = _params(tp_sharded=True)
        norm = clip_grad_norm_(ps, 1.0, dims=dims, norm_type=norm_type)
    assert norm.device == CUDA and norm.dtype == torch.float64 and norm.dim() == 0
    assert all(p.grad.device == CUDA for p in ps)
    rec.check(expect={"all_reduce"})
    assert not host.syncs, f"clipping read the device from the host: {host.syncs}"


def test_global_norm_dp_sharded_on_cuda(cuda_job):
    rec, host = cuda_job
    with fake_world(2):
        dims = CudaDims(tp=1, pp=1, dp=2)
        g = torch.randn(11, device=CUDA)
        norm = global_norm([(g, False), (g[:0], False)], dims=dims, dp_sharded=True)
    assert norm.device == CUDA
    rec.check(expect={"all_reduce"})
    assert not host.syncs


def test_global_norm_without_pieces_lives_on_the_mesh_device(cuda_job):
    """A rank holding no gradient (all its pieces empty) still all-reduces a CUDA scalar."""
    rec, _ = cuda_job
    with fake_world(2):
        dims = CudaDims(tp=1, pp=1, dp=2)
        norm = global_norm([], dims=dims, dp_sharded=True)
    assert norm.device == CUDA
    rec.check(expect={"all_reduce"})


# --- CPU numerics of the on-device clip coefficient ------------------------------------------


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g, dtype=torch.float64),
            torch.randn(123, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_by_matches_torch(max_norm):
    """float64, same formula as torch.nn.utils.clip_grad_norm_: equal to ~1e-15."""
    mine, ref = _grads(0), [nn.Parameter(torch.zeros(7, 5, dtype=torch.float64)),
                            nn.Parameter(torch.zeros(123, dtype=torch.float64))]
    for r, g in zip(ref, mine, strict=True):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    norm = global_norm([(g, False) for g in mine], dims=None)
    clip_by(norm, max_norm, mine)
    torch.testing.assert_close(norm, want, rtol=1e-15, atol=0)
    for r, g in zip(ref, mine, strict=True):
        torch.testing.assert_close(g, r.grad, rtol=1e-15, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_norm_leaves_grads_untouched(bad):
    grads = _grads(1)
    grads[1][3] = bad
    before = [g.clone() for g in grads]
    norm = global_norm([(g, False) for g in grads], dims=None)
    assert not torch.isfinite(norm)
    clip_by(norm, 0.05, grads)
    for g, b in zip(grads, before, strict=True):
        torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)
