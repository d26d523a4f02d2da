"""The MLP's backward fused across its two GEMMs on CUDA: ``gemm_dgelu`` (cuBLASLt's
DGELU_BGRAD epilogue, the Triton GEMM with the GeLU-derivative epilogue, and the reference)
and ``ParallelMLP`` at tp1 with each backend, forward and backward, against float64, with
the tolerances of the linear_gelu GPU tests. Multi-rank fused paths (tp > 1, sequence
parallelism) need more than one GPU; on CPU they run in tests/parallel/tensor."""

from __future__ import annotations

import pytest
import torch

from distllm.ops import gemm_dgelu
from tests.gpu.test_linear_gelu_cuda import TOL, _err

pytestmark = pytest.mark.gpu

CASES = [("cuda", "tanh"), ("triton", "tanh"), ("triton", "none"), ("reference", "none")]


@pytest.fixture(autouse=True)
def _fp32_is_fp32():
    assert torch.cuda.is_available(), "needs CUDA (run through bench/gpu_check.sh)"
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,approximate", CASES)
@pytest.mark.parametrize("shape", [(123, 256, 776), (1024, 512, 2048)])
def test_gemm_dgelu_cuda(backend, approximate, dtype, shape):
    m, p, n = shape  # dy (M, P) @ w2 (P, N) with pre (M, N)
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(m, p, generator=g, dtype=torch.float64)
    w2 = torch.randn(p, n, generator=g, dtype=torch.float64) * p**-0.5
    pre = torch.randn(m, n, generator=g, dtype=torch.float64)
    want = torch.ops.aten.gelu_backward(dy @ w2, pre, approximate=approximate)
    gu, db = gemm_dgelu(dy.to(dtype).cuda(), w2.to(dtype).cuda(), pre.to(dtype).cuda(),
                        bias_grad=True, approximate=approximate, backend=backend)
    assert _err(gu.cpu(), want) < TOL[dtype], backend
    # the bias gradient sums M rounded terms: the tolerance grows with sqrt(M)
    assert _err(db.cpu(), want.sum(0)) < TOL[dtype] * max(1.0, m**0.5 / 4), backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,approximate", CASES)
def test_parallel_mlp_tp1_cuda(backend, approximate, dtype):
    from distllm import ParallelDims
    from distllm.nn import ParallelMLP
    from distllm.nn.mlp import DenseMLP

    act = {"none": "gelu", "tanh": "gelu_tanh"}[approximate]
    torch.manual_seed(0)
    dense = DenseMLP(256, 1024, activation=act, dtype=torch.float64)
    dims = ParallelDims(tp=1, backend="gloo")
    mlp = ParallelMLP.from_dense(DenseMLP(256, 1024, activation=act, dtype=torch.float64), dims,
                                 backend=backend)
    mlp.load_state_dict({k: v for k, v in dense.state_dict().items()})
    mlp = mlp.to(device="cuda", dtype=dtype)
    x = torch.randn(4, 64, 256, dtype=torch.float64)
    gy = torch.randn(4, 64, 256, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    dense(xr).backward(gy)
    xc = x.to(dtype).cuda().requires_grad_()
    y = mlp(xc)
    y.backward(gy.to(dtype).cuda())
    assert _err(y.detach().cpu(), dense(x).detach()) < TOL[dtype]
    assert _err(xc.grad.cpu(), xr.grad) < TOL[dtype]
    for (name, p), (_, q) in zip(mlp.named_parameters(), dense.named_parameters(), strict=True):
        tol = TOL[dtype] * (16 if name.endswith("bias") else 1)  # sums over 256 tokens
        assert _err(p.grad.cpu(), q.grad) < tol, name
    assert mlp.overlap_stats["fc1"].kernel.startswith(f"{backend}:")
