"""GPT models built only from ``distllm.nn`` modules, and Hugging Face conversion."""

from __future__ import annotations

from distllm._lazy import lazy_exports

_LAZY = {
    "GPT": "distllm.models.gpt",
    "GPTConfig": "distllm.models.gpt",
    "PRESETS": "distllm.models.gpt",
    "from_hf": "distllm.models.hf",
    "to_hf": "distllm.models.hf",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY)
