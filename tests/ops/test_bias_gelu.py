"""The bias + GeLU epilogue ops (torch.ops.distllm.bias_gelu / bias_gelu_backward, C++ CPU
kernels) against float64 references: values, gradients (gradcheck), opcheck, odd and 3-D
non-contiguous shapes, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from distllm.ops import bias_gelu, bias_gelu_reference, extensions

# Relative tolerance per dtype (fraction of the reference's largest magnitude):
TOL = {
    torch.float64: 1e-12,  # elementwise in double: a few ulps of erf/tanh/exp
    torch.float32: 1e-6,  # computed in float: a few ulps of erf/tanh/exp
    torch.float16: 2e-3,  # one rounding of the output to 11 bits (2^-11 = 4.9e-4) + input
    torch.bfloat16: 1.6e-2,  # one rounding of the output to 8 bits (2^-8 = 3.9e-3) + input
}
SHAPES = [(1,), (7, 769), (123, 1000), (2, 3, 123)]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    # the kernels under test must exist
    assert extensions.load("_C") is not None, extensions.status("_C")


def _inputs(shape, dtype, bias=True, noncontig=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    if noncontig and x.dim() >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64) if bias else None
    return x.to(dtype), (b.to(dtype) if b is not None else None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_forward_and_backward_match_float64(shape, dtype, approximate):
    for bias, noncontig in ((True, False), (False, True)):
        x, b = _inputs(shape, dtype, bias, noncontig)
        xs = x.clone().requires_grad_()
        bs = b.clone().requires_grad_() if b is not None else None
        y = torch.ops.distllm.bias_gelu(xs, bs, approximate)
        xr = x.double().requires_grad_()
        br = b.double().requires_grad_() if b is not None else None
        ref = bias_gelu_reference(xr, br, approximate)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y.backward(g.to(dtype))
        ref.backward(g)
        for got, want in ((y, ref), (xs.grad, xr.grad)) + (((bs.grad, br.grad),) if bias else ()):
            scale = max(want.abs().max().item(), 1e-3)
            err = (got.double() - want).abs().max().item()
            assert got.dtype == dtype and err <= TOL[dtype] * scale, (err, scale)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gradcheck_float64(approximate):
    x, b = _inputs((5, 13), torch.float64)
    x.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, b: torch.ops.distllm.bias_gelu(x, b, approximate), (x, b)
    )


def test_backward_op_is_gelu_derivative():
    x, b = _inputs((7, 769), torch.float64)
    g = torch.randn(7, 769, dtype=torch.float64)
    for approximate in ("none", "tanh"):
        got = torch.ops.distllm.bias_gelu_backward(g, x, b, approximate)
        want = torch.ops.aten.gelu_backward(g, x + b, approximate=approximate)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_opcheck():
    x, b = _inputs((7, 33), torch.float32)
    x.requires_grad_()
    b.requires_grad_()
    for approximate in ("none", "tanh"):
        torch.library.opcheck(torch.ops.distllm.bias_gelu.default, (x, b, approximate))
        torch.library.opcheck(torch.ops.distllm.bias_gelu.default, (x, None, approximate))
        torch.library.opcheck(
            torch.ops.distllm.bias_gelu_backward.default,
            (torch.randn(7, 33), x.detach(), b.detach(), approximate),
        )


def test_public_function_matches_reference():
    x, b = _inputs((3, 4, 64), torch.float32, noncontig=True)
    torch.testing.assert_close(
        bias_gelu(x, b, "tanh"), F.gelu(x + b, approximate="tanh"), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(x, b, "erf")


@pytest.mark.parametrize(
    "bad_bias,match",
    [
        (torch.randn(63), r"bias_gelu: bias must be \(64,\)"),
        (torch.randn(2, 64), r"bias_gelu: bias must be \(64,\)"),
        (torch.randn(64, dtype=torch.float64), "bias_gelu: bias has dtype Double but x has"),
    ],
)
def test_bad_bias(bad_bias, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.distllm.bias_gelu(torch.randn(3, 64), bad_bias, "none")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, b: torch.ops.distllm.bias_gelu(x[0, 0], None, "none"), "x must have at least"),
        (lambda x, b: torch.ops.distllm.bias_gelu(x, b, "erf"), "approximate must be"),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x[:, :5], x, b, "none"),
            r"bias_gelu_backward: grad has shape \[3, 5\] but x has shape \[3, 64\]",
        ),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x.double(), x, b, "none"),
            "bias_gelu_backward: grad has dtype Double but x has dtype Float",
        ),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x, x, b[:3], "none"),
            r"bias_gelu_backward: bias must be \(64,\)",
        ),
        (  # an integer or fp8 x: no GeLU kernel of its dtype
            lambda x, b: torch.ops.distllm.bias_gelu(x.long(), None, "none"),
            "bias_gelu: x must be float32, float64, float16 or bfloat16, got Long",
        ),
        (
            lambda x, b: torch.ops.distllm.bias_gelu(x.to(torch.float8_e4m3fn), None, "none"),
            "bias_gelu: x must be float32, float64, float16 or bfloat16, got Float8_e4m3fn",
        ),
        (  # the extension's own function, called directly with a tensor of another device
            lambda x, b: extensions.load("_C").bias_gelu(x.to("meta"), None, "none"),
            "bias_gelu: x must be a cpu tensor, got one on meta",
        ),
    ],
)
def test_checks_name_the_argument(call, match):
    # the checks shared by the CPU and CUDA kernels (csrc/checks.h); the CUDA-only ones
    # (a bias or grad on another device) are in tests/gpu/test_bias_gelu_cuda.py
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(3, 64), torch.randn(64))


def test_ops_are_registered_by_their_module_not_by_the_extension():
    # distllm._C blocked: the op, its fake and its autograd exist all the same (distllm.ops
    # registers them), the fake serves torch.compile's tracing, and the eager op says which
    # extension is missing
    code = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "distllm._C":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import distllm
with FakeTensorMode():
    y = torch.ops.distllm.bias_gelu(torch.empty(3, 5), torch.empty(5), "none")
    assert y.shape == (3, 5), y.shape
try:
    torch.ops.distllm.bias_gelu(torch.randn(3, 5), None, "none")
except RuntimeError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "distllm._C is unavailable (blocked for the test)" in out.stdout, out.stdout
