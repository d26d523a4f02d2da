"""The CPU GEMMs of distllm's own autograd functions: oneDNN's linear or torch's GEMM,
whichever measured faster for the shape (its rows rounded up to a power of two).

On x86 CPUs torch's float32 GEMM (``mm``/``addmm``) and oneDNN's linear
(``mkldnn._linear_pointwise``) are different libraries, and neither wins everywhere: on a
2-core AMD EPYC (Zen 5, 2 threads) oneDNN's linear ran (2048, 1024) @ (1024, 4096) 2.2x
faster; on a 2-core Zen 4 (one thread) 1.04x-1.13x faster at the GEMMs of a GPT-2-width
layer split over 2 ranks; on an earlier AMD EPYC (one thread) torch's won the input-gradient
GEMM (256, 3072) @ (3072, 768) by 1.8x; on a 2-core Xeon with AMX they ran at the same
speed. So each GEMM shape is measured once per process (both candidates on the caller's own
tensors, :mod:`distllm.ops.backend_choice`) and the faster one runs from then on; its rows M
count as the next power of two, so the shapes of varying sequence lengths share one
measurement per (bucket of rows, K, N).

Who uses it: the CPU backend of the fused GEMM + bias + GeLU
(:mod:`distllm.ops.linear_gelu_backends`) and the tensor-parallel GEMMs that distllm runs
itself (the overlap engines' chunks, the column-parallel forward, the row-parallel input
gradient: :mod:`distllm.parallel.tensor.layers`, :mod:`distllm.parallel.tensor.fused_mlp`).
float32 only: torch's bfloat16 GEMM on CPU already is oneDNN's, and float64 (the parity
tests' dtype) is torch's alone. Other devices, fake tensors and empty operands run torch's.
The weight-gradient GEMM stays torch's (``g.t() @ x``): oneDNN would need both operands
copied into its layout there, and with the copies it was no faster on the Zen 4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from distllm.ops import backend_choice

__all__ = ["onednn_linear_ok", "onednn_dtype_ok", "onednn_or_torch", "mm_t", "mm"]


@functools.cache
def onednn_linear_ok() -> bool:
    """Whether torch exposes oneDNN's fused linear (``mkldnn._linear_pointwise``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def onednn_dtype_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs ``dtype`` here, and right (probed once per dtype)."""
    if not onednn_linear_ok() or dtype not in (torch.float32, torch.bfloat16):
        return False
    with _disable_current_modes():  # a real probe, also when first asked under fake tensors
        g = torch.Generator().manual_seed(0)  # the caller's random state is not ours
        x = torch.randn(3, 8, dtype=dtype, generator=g)
        w = torch.randn(5, 8, dtype=dtype, generator=g)
        try:
            got = torch.ops.mkldnn._linear_pointwise(x, w, None, "gelu", [], "none")
        except RuntimeError:
            return False
        ref = F.gelu(F.linear(x.float(), w.float()))
        return bool(torch.allclose(got.float(), ref, atol=5e-2, rtol=5e-2))


def onednn_or_torch(kind: str, a: torch.Tensor, w: torch.Tensor, onednn: Callable[[], object],
                    plain: Callable[[], object]):
    """The result of ``onednn()`` or of ``plain()`` (torch's GEMM), whichever measured faster
    for this ``kind`` of GEMM at these shapes on this machine (measured on first use, then
    cached by :func:`distllm.ops.backend_choice.choose` for ``a``'s rows rounded up to a power
    of two, the other dimensions exact). oneDNN only where it takes the dtype
    and the operands are not empty; under fake tensors, torch's (nothing to measure)."""
    if is_fake(a) or not (onednn_dtype_ok(a.dtype) and a.numel() > 0 and w.numel() > 0):
        return plain()
    key = f"cpu_gemm|{kind}|{a.dtype}|{backend_choice.gemm_shape_key(a, w)}"
    name = backend_choice.lookup(key, a.device) or backend_choice.choose(
        key, a.device, {"onednn": onednn, "torch": plain})
    return onednn() if name == "onednn" else plain()


def _measured(a: torch.Tensor, w: torch.Tensor) -> bool:
    """float32 on CPU, contiguous operands (oneDNN's linear takes its weight as given)."""
    return (a.device.type == "cpu" and a.dtype == torch.float32 and a.is_contiguous()
            and w.is_contiguous())


def _product(kind: str, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
             out: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` (into ``out`` when given), ``b`` being the linear weight ``w`` or
    ``w.T``; oneDNN's linear takes ``b.T`` as its (out, in) weight. The bias goes into the
    GEMM's accumulator, so a bf16/fp16 result is rounded once, as ``F.linear``'s is."""
    def plain():
        if bias is not None:
            return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)

    if not _measured(a, w):
        return plain()

    def onednn():
        y = torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")
        return y if out is None else out.copy_(y)

    return onednn_or_torch(kind, a, w, onednn, plain)


def mm_t(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T (+ bias)`` for ``a`` (M, K), ``w`` (N, K), a linear layer's weight, and
    ``bias`` (N,); into ``out`` (M, N) when given. Not differentiable: for the forward and
    backward of autograd functions."""
    return _product("mm_t", a, w, w.t(), out, bias)


def mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w`` for ``a`` (M, N) and ``w`` (N, K), a linear layer's weight (the input-gradient
    GEMM); into ``out`` (M, K) when given. Not differentiable."""
    return _product("mm", a, w, w, out)
