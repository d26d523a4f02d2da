"""Fused ops, one public function each (autograd + backend dispatch:
cuda extension -> triton -> cpu -> reference)."""

from __future__ import annotations

import sys
import types

from distllm._lazy import lazy_exports

_LAZY = {
    "bias_gelu": "distllm.ops.bias_gelu",
    "bias_gelu_reference": "distllm.ops.bias_gelu",
    "linear_gelu": "distllm.ops.linear_gelu",
    "linear_gelu_reference": "distllm.ops.linear_gelu",
    "backends": "distllm.ops.linear_gelu",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)


class _OpsPackage(types.ModuleType):
    """Keeps each public name bound to its function: importing the submodule of the same name
    (``distllm.ops.linear_gelu``, by any import path and in any order) would otherwise bind
    the submodule over it."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType) and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _OpsPackage
