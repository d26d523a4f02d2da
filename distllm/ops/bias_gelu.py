"""``bias_gelu(x, bias, approximate)``: the GeLU epilogue on its own, gelu(x + bias).

Registered with ``torch.library`` here, in the order every op of this package follows:

1. the custom ops ``distllm::bias_gelu(x, bias?, approximate) -> y`` and
   ``distllm::bias_gelu_backward(grad, x, bias?, approximate) -> grad * gelu'(x + bias)``,
   whose kernels are the compiled extensions' (``distllm._C`` on CPU, ``distllm._cuda`` on
   CUDA; ``csrc/bias_gelu.cpp``, ``csrc/cuda/bias_gelu.cu``);
2. their fake (meta) implementations, for ``torch.compile``;
3. the autograd formula of ``bias_gelu``;
4. the public function, which falls back to the pure-PyTorch reference when the extension
   for the input's device is missing (with a one-line warning, once).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from distllm.ops import extensions

__all__ = ["bias_gelu", "bias_gelu_reference"]

_APPROX = ("none", "tanh")
_EXTENSION = {"cpu": "_C", "cuda": "_cuda"}  # device type -> the extension with its kernels


def _kernels(x: torch.Tensor) -> ModuleType:
    """The compiled extension serving ``x``'s device; RuntimeError naming why if there is none."""
    name = _EXTENSION.get(x.device.type)
    if name is None:
        raise RuntimeError(
            f"distllm::bias_gelu has kernels for CPU and CUDA tensors only, got {x.device}"
        )
    mod = extensions.load(name)
    if mod is None:
        raise RuntimeError(
            f"distllm::bias_gelu on {x.device.type}: distllm.{name} is unavailable "
            f"({extensions.status(name)[1]}); call distllm.ops.bias_gelu, which falls back to "
            "the reference"
        )
    return mod


# ----------------------------------------------------------------------------- 1. custom ops
@torch.library.custom_op("distllm::bias_gelu", mutates_args=())
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return _kernels(x).bias_gelu(x, bias, approximate)


@torch.library.custom_op("distllm::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> torch.Tensor:
    return _kernels(x).bias_gelu_backward(grad, x, bias, approximate)


# ----------------------------------------------------------------------------- 2. fakes
@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_bias_gelu_backward_op.register_fake
def _(grad, x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- 3. autograd
def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, grad):
    x, bias = ctx.saved_tensors
    gpre = torch.ops.distllm.bias_gelu_backward(grad.contiguous(), x, bias, ctx.approximate)
    gbias = None
    if bias is not None and ctx.needs_input_grad[1]:
        gbias = gpre.reshape(-1, gpre.shape[-1]).sum(0)  # (rows, N) -> (N,)
    return gpre, gbias, None


_bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- 4. public
def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """Reference: ``F.gelu(x + bias)``, the oracle of the tests and the last fallback."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"
) -> torch.Tensor:
    """gelu(x + bias) over the last dimension of ``x``; ``bias`` is ``(x.shape[-1],)``.

    Differentiable in ``x`` and ``bias``. Runs the compiled kernel of ``x``'s device when its
    extension is built, else the reference."""
    if approximate not in _APPROX:
        raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
    name = _EXTENSION.get(x.device.type)
    if name is not None and extensions.load(name) is not None:
        return torch.ops.distllm.bias_gelu(x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)
