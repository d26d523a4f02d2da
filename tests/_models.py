"""Toy models shared by the tests: one home, so every suite trains the same small block."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Block"]


class Block(nn.Module):
    """A pre-norm residual MLP block, ``x + down(gelu(up(ln(x))))``: the shape of a
    transformer layer's second half, small enough for float64 parity tests.

    Args:
        h: hidden size (input and output).
        f: inner (MLP) size.
    """

    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h)

    def forward(self, x: Tensor) -> Tensor:  # (..., h) -> (..., h)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))
