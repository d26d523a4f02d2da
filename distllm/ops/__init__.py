"""Fused ops, one public function each (autograd + backend dispatch:
cuda extension -> triton -> cpu -> reference)."""

from __future__ import annotations

import importlib

_LAZY = {
    "bias_gelu": "distllm.ops.bias_gelu",
    "bias_gelu_reference": "distllm.ops.bias_gelu",
    "linear_gelu": "distllm.ops.linear_gelu",
    "linear_gelu_reference": "distllm.ops.linear_gelu",
    "backends": "distllm.ops.linear_gelu",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        # importing distllm.ops.<op> binds the submodule as an attribute of this package;
        # rebind the public name to the function so that `from distllm.ops import <op>` works
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distllm.ops' has no attribute {name!r}")
