"""Python side of the ``torch.ops.distllm`` ops whose kernels live in the extensions:
fake (meta) implementations for torch.compile and autograd formulas.

The schemas are defined in C++ (``csrc/bias_gelu.cpp``); this runs once, when
``distllm._C`` is first loaded.
"""

from __future__ import annotations

import torch

_done = False


def register_python_side() -> None:
    global _done
    if _done:
        return
    _done = True

    @torch.library.register_fake("distllm::bias_gelu")
    def _bias_gelu_fake(x, bias, approximate):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("distllm::bias_gelu_backward")
    def _bias_gelu_backward_fake(grad, x, bias, approximate):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def _setup(ctx, inputs, output):
        x, bias, approximate = inputs
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate

    def _backward(ctx, grad):
        x, bias = ctx.saved_tensors
        gpre = torch.ops.distllm.bias_gelu_backward(grad.contiguous(), x, bias, ctx.approximate)
        gbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            gbias = gpre.reshape(-1, gpre.shape[-1]).sum(0)
        return gpre, gbias, None

    torch.library.register_autograd("distllm::bias_gelu", _backward, setup_context=_setup)
