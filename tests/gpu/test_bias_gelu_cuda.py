"""The CUDA bias + GeLU kernels (distllm._cuda: torch.ops.distllm.bias_gelu and
bias_gelu_backward on CUDA tensors) against float64 references: erf and tanh, every dtype,
odd sizes (1, 7, 123, 769), 3-D and non-contiguous inputs, gradcheck in float64, opcheck,
and the argument checks (a bias on another device names the argument)."""

from __future__ import annotations

import pytest
import torch

from distllm.ops import bias_gelu, bias_gelu_reference, extensions

pytestmark = pytest.mark.gpu

# Relative tolerance per dtype (fraction of the reference's largest magnitude):
TOL = {
    torch.float64: 1e-12,  # elementwise in double: a few ulps of erf/tanh/exp
    torch.float32: 2e-6,  # computed in float: a few ulps of the device's erff/tanhf/expf
    torch.float16: 2e-3,  # one rounding of the output to 11 bits (2^-11 = 4.9e-4) + input
    torch.bfloat16: 1.6e-2,  # one rounding of the output to 8 bits (2^-8 = 3.9e-3) + input
}
SHAPES = [(1,), (7, 769), (123, 1000), (2, 3, 123), (1, 7)]


@pytest.fixture(scope="module", autouse=True)
def _cuda_ext():
    assert torch.cuda.is_available(), "needs CUDA (run through bench/gpu_check.sh)"
    assert extensions.load("_cuda") is not None, extensions.status("_cuda")


def _inputs(shape, dtype, bias=True, noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64) if bias else None
    x = x.to(dtype).cuda()
    if noncontig and x.dim() >= 2:  # same values, transposed memory layout
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    return x, (b.to(dtype).cuda() if b is not None else None)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-3)
    return (got.double() - want).abs().max().item() / scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cuda_forward_and_backward_match_float64(shape, dtype, approximate):
    for bias, noncontig in ((True, False), (False, True), (True, True)):
        x, b = _inputs(shape, dtype, bias, noncontig)
        xs = x.clone().requires_grad_()
        bs = b.clone().requires_grad_() if b is not None else None
        y = torch.ops.distllm.bias_gelu(xs, bs, approximate)
        xr = x.double().requires_grad_()
        br = b.double().requires_grad_() if b is not None else None
        ref = bias_gelu_reference(xr, br, approximate)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y.backward(g.to(dtype).cuda())
        ref.backward(g.cuda())
        pairs = [("y", y, ref), ("dx", xs.grad, xr.grad)]
        if bias:
            pairs.append(("db", bs.grad, br.grad))
        for name, got, want in pairs:
            assert got.is_cuda and got.dtype == dtype, name
            assert _err(got, want) <= TOL[dtype], (name, _err(got, want))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cuda_backward_op_is_gelu_derivative(approximate):
    x, b = _inputs((7, 769), torch.float64)
    g = torch.randn(7, 769, dtype=torch.float64, device="cuda")
    got = torch.ops.distllm.bias_gelu_backward(g, x, b, approximate)
    want = torch.ops.aten.gelu_backward(g.cpu(), (x + b).cpu(), approximate=approximate)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cuda_gradcheck_float64(approximate):
    x, b = _inputs((5, 13), torch.float64)
    x.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, b: torch.ops.distllm.bias_gelu(x, b, approximate), (x, b)
    )


def test_cuda_opcheck():
    x, b = _inputs((7, 33), torch.float32)
    x.requires_grad_()
    b.requires_grad_()
    g = torch.randn(7, 33, device="cuda")
    for approximate in ("none", "tanh"):
        torch.library.opcheck(torch.ops.distllm.bias_gelu.default, (x, b, approximate))
        torch.library.opcheck(torch.ops.distllm.bias_gelu.default, (x, None, approximate))
        torch.library.opcheck(
            torch.ops.distllm.bias_gelu_backward.default, (g, x.detach(), b.detach(), approximate)
        )


def test_public_function_runs_the_cuda_kernel():
    x, b = _inputs((3, 4, 64), torch.float32, noncontig=True)
    y = bias_gelu(x, b, "tanh")
    assert y.is_cuda
    assert _err(y, bias_gelu_reference(x.double(), b.double(), "tanh")) <= TOL[torch.float32]


@pytest.mark.parametrize(
    "make,match",
    [
        # a CPU bias would reach the kernel as a host pointer
        (lambda x, b: torch.ops.distllm.bias_gelu(x, b.cpu(), "none"), r"bias is on cpu"),
        (lambda x, b: torch.ops.distllm.bias_gelu(x, b[:-1], "none"), r"bias must be \(64,\)"),
        (lambda x, b: torch.ops.distllm.bias_gelu(x, b.double(), "none"), r"bias has dtype"),
        (lambda x, b: torch.ops.distllm.bias_gelu(x, b, "erf"), "approximate"),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x.cpu(), x, b, "none"),
            r"grad is on cpu",
        ),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x[:, :5], x, b, "none"),
            r"grad has shape",
        ),
        (
            lambda x, b: torch.ops.distllm.bias_gelu_backward(x.half(), x, b, "none"),
            r"grad has dtype",
        ),
    ],
)
def test_cuda_checks_name_the_argument(make, match):
    x, b = _inputs((3, 64), torch.float32)
    with pytest.raises(RuntimeError, match=match):
        make(x, b)
        torch.cuda.synchronize()
