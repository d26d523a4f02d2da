"""FusedLinearGeLU and fuse(model) under ``torch.autocast`` (bfloat16 on CPU): they follow
autocast as nn.Linear does (operands cast to the autocast dtype, gradients back in the
parameters' dtype), against a float64 reference of the same weights; float64 operands are
left alone (autocast's rule); outside autocast a bf16 input with fp32 weights is still an
error (as for F.linear)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

from distllm.nn import FusedLinearGeLU, fuse

# bf16 operands (x and W each rounded to 8 mantissa bits, 2^-9 relative) into an
# fp32-accumulated GEMM, then the output rounded to bf16 (2^-9): a few 2^-9 per element,
# relative to the largest magnitude; gradients see the same roundings once more.
BF16_TOL = 3e-2


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-3)


def _check_against_float64(model: nn.Module, ref64: nn.Module, x: torch.Tensor, backend: str):
    """``model`` (fp32 params) under bf16 autocast vs ``ref64`` (the same weights in float64)."""
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(xa)
    assert y.dtype == torch.bfloat16
    xr = x.double().requires_grad_()
    yr = ref64(xr)
    assert _rel_err(y, yr) <= BF16_TOL
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(g.to(y.dtype))
    yr.backward(g)
    assert xa.grad.dtype == x.dtype and _rel_err(xa.grad, xr.grad) <= BF16_TOL
    for (name, p), pr in zip(model.named_parameters(), ref64.parameters(), strict=True):
        assert p.grad.dtype == torch.float32, name  # back in the parameter's dtype
        assert _rel_err(p.grad, pr.grad) <= BF16_TOL, name


@pytest.mark.parametrize("backend", ["cpu", "reference", "auto"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_gelu_follows_autocast(backend, x_dtype):
    torch.manual_seed(0)
    layer = FusedLinearGeLU(123, 769, approximate="tanh")
    ref = copy.deepcopy(layer).double()
    x = torch.randn(3, 7, 123).to(x_dtype)
    _check_against_float64(layer, ref, x, backend)


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_fused_models_follow_autocast(backend):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    ref = copy.deepcopy(seq).double()
    assert fuse(seq) == 1
    _check_against_float64(seq, ref, torch.randn(2, 123, 64), backend)
    # a Hugging Face block with a Conv1D (weight stored (in, out)) and gelu_new
    mlp = GPT2MLP(256, GPT2Config(n_embd=64, resid_pdrop=0.0))
    ref = copy.deepcopy(mlp).double()
    assert fuse(mlp) == 1
    _check_against_float64(mlp, ref, torch.randn(2, 7, 64), backend)


def test_float64_is_left_alone_under_autocast():
    torch.manual_seed(0)
    layer = FusedLinearGeLU(33, 17).double()
    x = torch.randn(5, 33, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


def test_mixed_dtypes_outside_autocast_are_still_an_error():
    layer = FusedLinearGeLU(16, 8)
    with pytest.raises(ValueError, match="one dtype"):
        layer(torch.randn(2, 16, dtype=torch.bfloat16))
