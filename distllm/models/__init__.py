"""GPT models built only from ``distllm.nn`` modules, and Hugging Face conversion."""

from __future__ import annotations

import importlib

_LAZY = {
    "GPT": "distllm.models.gpt",
    "GPTConfig": "distllm.models.gpt",
    "PRESETS": "distllm.models.gpt",
    "from_hf": "distllm.models.hf",
    "to_hf": "distllm.models.hf",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distllm.models' has no attribute {name!r}")
