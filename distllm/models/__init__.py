"""GPT models built only from ``distllm.nn`` modules, and Hugging Face conversion.

- ``config``: :class:`GPTConfig` and the size :data:`PRESETS`;
- ``gpt``: :class:`GPT`, its layers and its loss (it also exports ``config``'s names);
- ``hf``: :func:`from_hf` / :func:`to_hf`, GPT-2 checkpoints in and out;
- ``sharding``: a layer's canonical (unsharded) weights, loaded into its TP shards and
  gathered back (initialisation, conversion), and where each shard's parts sit in them
  (checkpoints).
"""

from __future__ import annotations

from distllm.models.config import PRESETS, GPTConfig
from distllm.models.gpt import GPT
from distllm.models.hf import from_hf, to_hf

__all__ = ["GPT", "GPTConfig", "PRESETS", "from_hf", "to_hf"]
