"""``bias_gelu(x, bias, approximate)``: the GeLU epilogue on its own, gelu(x + bias).

Backends: the compiled ops ``torch.ops.distllm.bias_gelu`` (CPU kernel in ``distllm._C``,
CUDA kernel in ``distllm._cuda``), else the pure-PyTorch reference. Differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distllm import _ext

_APPROX = ("none", "tanh")


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"):
    """Reference: ``F.gelu(x + bias)``, the oracle of the tests and the last fallback."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"):
    """gelu(x + bias) over the last dimension of ``x``; ``bias`` is ``(x.shape[-1],)``."""
    if approximate not in _APPROX:
        raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
    ext = "_cuda" if x.is_cuda else "_C"
    if _ext.load(ext) is not None:
        return torch.ops.distllm.bias_gelu(x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)
