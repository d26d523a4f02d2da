"""linear_gelu under ``torch.compile`` with Inductor on CPU: the registered ops
(``distllm::linear_gelu_fwd`` / ``_bwd``) stay whole in the compiled graph (``fullgraph=True``,
no graph break), and the compiled forward and backward equal eager's."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from distllm.ops import linear_gelu

F64 = dict(rtol=1e-12, atol=1e-12)  # float64, the same kernels: only association order differs


def _leaves(seed: int = 0, lead=(3,)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 7, 32, generator=g, dtype=torch.float64)  # 3-D input
    w = torch.randn(24, 32, generator=g, dtype=torch.float64) / 32**0.5
    b = torch.randn(24, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, w, b)]


def _step(backend: str, approximate: str):
    def f(x, w, b):
        y = linear_gelu(x, w, b, approximate=approximate, backend=backend)
        return (y * y).sum(), y  # a loss whose gradient depends on y

    return f


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_inductor_fullgraph_forward_and_backward_match_eager(backend, approximate):
    torch._dynamo.reset()
    f = _step(backend, approximate)
    eager, compiled = _leaves(), _leaves()
    loss_e, y_e = f(*eager)
    loss_e.backward()
    cf = torch.compile(f, backend="inductor", fullgraph=True)

    def run():
        loss_c, y_c = cf(*compiled)
        loss_c.backward()
        return loss_c, y_c

    (loss_c, y_c), code = run_and_get_code(run)
    src = "\n".join(code)
    # both registered ops reach Inductor's generated code as calls (neither traced through)
    assert "distllm.linear_gelu_fwd" in src, "the forward op is not in the compiled code"
    assert "distllm.linear_gelu_bwd" in src, "the backward op is not in the compiled code"
    torch.testing.assert_close(y_c, y_e, **F64, msg="forward")
    torch.testing.assert_close(loss_c, loss_e, **F64, msg="loss")
    for name, c, e in zip(("dx", "dw", "db"), compiled, eager, strict=True):
        torch.testing.assert_close(c.grad, e.grad, **F64, msg=name)


def test_inductor_recompiles_for_a_new_shape_without_a_graph_break():
    torch._dynamo.reset()
    f = _step("cpu", "tanh")
    cf = torch.compile(f, backend="inductor", fullgraph=True)
    for lead in ((3,), (5,)):  # a second batch size: recompiled (or dynamic), still one graph
        eager, compiled = _leaves(1, lead), _leaves(1, lead)
        loss_e, _ = f(*eager)
        loss_e.backward()
        loss_c, _ = cf(*compiled)
        loss_c.backward()
        torch.testing.assert_close(loss_c, loss_e, **F64)
        for c, e in zip(compiled, eager, strict=True):
            torch.testing.assert_close(c.grad, e.grad, **F64)


def _mlp_module(kind: str) -> torch.nn.Module:
    """A module whose forward is one fused MLP (or the fused first layer) on one device."""
    from distllm import ParallelDims
    from distllm.nn import ColumnParallelLinear, ParallelMLP, fuse
    from distllm.nn.mlp import DenseMLP

    torch.manual_seed(0)
    dense = DenseMLP(32, 48, dtype=torch.float64)
    if kind in ("fuse", "fuse-pair"):  # what fuse() makes of a Linear -> GELU -> Linear:
        # a fused MLP, or a FusedLinearGeLU and the Linear
        seq = torch.nn.Sequential(dense.fc1, torch.nn.GELU(), dense.fc2)
        assert fuse(seq, mlp=kind == "fuse")
        return seq
    dims = ParallelDims(tp=1)
    if kind == "column":
        return ColumnParallelLinear.from_dense(dense.fc1, dims, activation="gelu")
    return ParallelMLP.from_dense(dense, dims, backend="cpu" if kind == "mlp-cpu" else "auto")


@pytest.mark.parametrize("kind", ["fuse", "fuse-pair", "column", "mlp-auto", "mlp-cpu"])
def test_the_fused_modules_compile_whole_and_match_eager(kind):
    """The modules a user compiles, not only the op: ``fullgraph=True`` (no graph break, which
    an import in the backend choice caused), forward and backward equal to eager (the fused
    MLP's own autograd Function saved views Dynamo cannot trace)."""
    torch._dynamo.reset()
    module = _mlp_module(kind)
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye = module(xe)
    ge = torch.autograd.grad((ye * ye).sum(), [xe, *module.parameters()])
    yc = torch.compile(module, backend="aot_eager", fullgraph=True)(xc)
    gc = torch.autograd.grad((yc * yc).sum(), [xc, *module.parameters()])
    torch.testing.assert_close(yc, ye, **F64, msg="forward")
    for i, (c, e) in enumerate(zip(gc, ge, strict=True)):
        torch.testing.assert_close(c, e, **F64, msg=f"gradient {i}")
