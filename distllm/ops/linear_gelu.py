"""``linear_gelu(x, weight, bias=None, *, approximate="none", backend="auto")``:
y = gelu(x @ weight.T + bias), differentiable. (Reference backend.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_gelu_reference(x, weight, bias=None, approximate="none"):
    """Plain PyTorch: the oracle of the tests and the last fallback."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                approximate: str = "none", backend: str = "auto") -> torch.Tensor:
    return linear_gelu_reference(x, weight, bias, approximate)


def backends() -> dict[str, str]:
    return {"reference": "ok"}
