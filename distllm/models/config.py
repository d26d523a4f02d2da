"""The shape of a GPT (:class:`GPTConfig`), its size :data:`PRESETS`, and the choices a
model is built with (:data:`CHECKPOINTING`, :data:`VOCAB_PARALLEL`). The model itself is
:mod:`distllm.models.gpt`'s."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from numbers import Real

__all__ = ["GPTConfig", "PRESETS", "CHECKPOINTING", "VOCAB_PARALLEL"]

CHECKPOINTING = ("none", "selective", "full")
"""Activation checkpointing of a :class:`Block`: none, selective (recompute the attention
core, softmax(QK^T)V, from the Q, K, V it keeps: Megatron-LM's selective recomputation) or
full (keep the block's input, recompute the whole block)."""

VOCAB_PARALLEL = ("auto", "on", "off")
"""Whether the embedding and the head split the vocabulary over TP: auto (split unless the
vocabulary is small, see :func:`splits_vocab`), on, or off (held whole by every TP rank)."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style model."""

    vocab_size: int = 256
    """Real vocabulary size (the byte tokenizer has 256); padded per TP size at build time."""
    n_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 128
    """Model width."""
    n_heads: int = 4
    """Attention (query) heads."""
    ffn_hidden_size: int = 512
    """MLP inner width (4 * hidden in GPT-2)."""
    max_seq_len: int = 128
    """Context length (rows of the learned position embedding)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: as many as query heads)."""
    activation: str = "gelu_tanh"
    """MLP activation: gelu_tanh (GPT-2's ``gelu_new``) or gelu (exact)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head (only with pp=1)."""
    init_std: float = 0.02
    """Normal init std; residual output projections use init_std / sqrt(2 * n_layers)."""
    name: str = "custom"
    """Preset name (informational; checked when loading a checkpoint)."""

    def __post_init__(self) -> None:
        for f in ("vocab_size", "n_layers", "hidden_size", "n_heads", "ffn_hidden_size",
                  "max_seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # (true is not 1 layer)
                raise ValueError(f"GPTConfig.{f}={v!r}: it must be a positive integer")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"n_heads={self.n_heads}: choose n_heads dividing it")
        kv = self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise ValueError(f"GPTConfig.n_kv_heads={self.n_kv_heads!r}: give a positive number "
                             f"of heads, or None (as many as n_heads)")
        if self.n_heads % kv:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} does not divide "
                             f"n_heads={self.n_heads}: choose a divisor of {self.n_heads}")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"activation={self.activation!r}: choose gelu or gelu_tanh")
        eps = self.layer_norm_eps
        if not _real(eps) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"GPTConfig.layer_norm_eps={eps!r}: it must be a finite number "
                             f"> 0 (GPT-2's is 1e-5)")
        std = self.init_std
        if not _real(std) or not math.isfinite(std) or std < 0:
            raise ValueError(f"GPTConfig.init_std={std!r}: it must be a finite number >= 0 "
                             f"(GPT-2's is 0.02)")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r}: it must be "
                             f"a bool (true or false)")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def n_pipeline_layers(self) -> int:
        """Entries of the layer list: embedding, blocks, head."""
        return self.n_layers + 2

    def padded_vocab(self, tp: int) -> int:
        m = 64 * tp
        return (self.vocab_size + m - 1) // m * m

    def num_params(self) -> int:
        h, f, L, v = self.hidden_size, self.ffn_hidden_size, self.n_layers, self.vocab_size
        qkv = h * (self.n_heads + 2 * self.kv_heads) * self.head_dim
        block = qkv + (self.n_heads + 2 * self.kv_heads) * self.head_dim + h * h + h
        block += 2 * h * f + f + h + 4 * h
        head = 2 * h + (0 if self.tie_embeddings else v * h)
        return v * h + self.max_seq_len * h + L * block + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 per weight of a matmul -- each
        block's QKV, out-projection and MLP, and the output head's v x h (tied or not: the
        input embedding is a lookup) -- plus the attention scores and their weighting,
        12 L h s. Biases, norms and positions are not counted."""
        h, f, L, v = self.hidden_size, self.ffn_hidden_size, self.n_layers, self.vocab_size
        qkv = h * (self.n_heads + 2 * self.kv_heads) * self.head_dim  # (h, (a + 2 kv) d)
        block = qkv + h * h + 2 * h * f  # QKV, out-projection, MLP in and out
        return 6.0 * (L * block + v * h) + 12.0 * L * h * seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def presets() -> list[str]:
        return list(PRESETS)

    @staticmethod
    def preset(name: str, **overrides) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides)


def _real(v) -> bool:
    """Whether ``v`` is a real number (an int or a float; not a bool, not a string)."""
    return isinstance(v, Real) and not isinstance(v, bool)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layers=4, hidden_size=128, n_heads=4, ffn_hidden_size=512,
                      max_seq_len=128, name="tiny"),
    "gpt2-small": GPTConfig(vocab_size=50257, n_layers=12, hidden_size=768, n_heads=12,
                            ffn_hidden_size=3072, max_seq_len=1024, name="gpt2-small"),
    "gpt2-medium": GPTConfig(vocab_size=50257, n_layers=24, hidden_size=1024, n_heads=16,
                             ffn_hidden_size=4096, max_seq_len=1024, name="gpt2-medium"),
    "gpt2-xl": GPTConfig(vocab_size=50257, n_layers=48, hidden_size=1600, n_heads=25,
                         ffn_hidden_size=6400, max_seq_len=1024, name="gpt2-xl"),
}
