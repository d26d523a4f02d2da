"""Model shapes for the planner: sizes only, no weights (the vocabulary padding alone is read
from :mod:`distllm.models`, whose rule it is).

A :class:`ModelShape` describes a decoder-only transformer by the numbers the cost model
needs (layers, hidden, heads, KV heads, FFN, vocabulary, sequence, global batch) plus the
few architectural switches that change parameter and activation counts (gated MLP, learned
positions, tied embeddings, biases, dropout). ``preset(name)`` returns the published shapes
and the GPT presets of :mod:`distllm.models` (read from ``GPTConfig`` when it is there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

__all__ = ["ModelShape", "preset", "PRESETS", "preset_names"]


@functools.cache
def _model_padded_vocab(vocab: int, tp: int) -> int:
    """Rows of distllm's embedding for a vocabulary of ``vocab`` at tensor parallelism ``tp``:
    the model's own rule, so that the planner and the code cannot disagree."""
    from distllm.models import GPTConfig  # lazy: pulls in torch

    return GPTConfig(vocab_size=vocab).padded_vocab(tp)


@functools.cache
def _model_splits_vocab(vocab: int, hidden: int, tp: int, sequence_parallel: bool) -> bool:
    """Whether distllm's embedding and head split the vocabulary over ``tp``
    (``vocab_parallel="auto"``): the model's own rule, as for the padding."""
    from distllm.models.gpt import splits_vocab  # lazy: pulls in torch

    return splits_vocab(vocab, hidden, tp, sequence_parallel)


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes, as the cost model sees them."""

    name: str
    """Display name (a preset name or ``custom``)."""
    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width h."""
    heads: int
    """Attention (query) heads a."""
    ffn: int
    """MLP inner width f (per matrix; a gated MLP has three such matrices)."""
    vocab: int
    """Vocabulary size before padding."""
    seq_len: int
    """Tokens per sequence s."""
    global_batch: int
    """Sequences per optimizer step B."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means equal to ``heads``."""
    vocab_multiple: int | None = None
    """The embedding is padded to a multiple of ``vocab_multiple * tp`` rows; None: as
    distllm's model pads it (``distllm.models.GPTConfig.padded_vocab``)."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with three matrices (Llama) instead of two (GPT)."""
    learned_positions: bool = True
    """A learned position table of ``seq_len x hidden`` (GPT); False for rotary (Llama)."""
    tied_embeddings: bool = True
    """Output head shares the input embedding (still a copy on the last stage when pp > 1)."""
    biases: bool = True
    """Linear layers and norms carry biases (GPT); Llama has none and uses RMSNorm."""
    dropout: bool = False
    """Dropout on: one byte of mask per dropped element is kept for backward."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for knob in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "global_batch"):
            v = getattr(self, knob)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                flag = "--" + knob.replace("_", "-")
                raise ValueError(f"{knob}={v!r}: it must be a positive integer (set {flag})")
        if self.kv_heads < 0:
            raise ValueError(f"kv_heads={self.kv_heads}: set --kv-heads to 0 (= heads) or a "
                             "positive count")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}: choose --heads "
                f"from {[d for d in range(1, min(self.hidden, 256) + 1) if self.hidden % d == 0]}"
            )
        if self.heads % self.n_kv_heads:
            raise ValueError(
                f"heads={self.heads} is not divisible by kv_heads={self.n_kv_heads}: choose "
                f"--kv-heads from {[d for d in range(1, self.heads + 1) if self.heads % d == 0]}"
            )

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def padded_vocab(self, tp: int = 1) -> int:
        if self.vocab_multiple is None:
            return _model_padded_vocab(self.vocab, tp)
        m = self.vocab_multiple * tp
        return math.ceil(self.vocab / m) * m

    def splits_vocab(self, tp: int, sequence_parallel: bool = False) -> bool:
        """Whether the embedding and the head split the vocabulary over ``tp`` ranks:
        distllm's rule (``vocab_parallel="auto"``: held whole when ``vocab * (tp - 1) <= 2 *
        hidden``, see :func:`distllm.models.gpt.splits_vocab`) for its own shapes, always for
        a runtime's own padding (``vocab_multiple`` set)."""
        if tp == 1 or self.vocab_multiple is not None:
            return True
        return _model_splits_vocab(self.vocab, self.hidden, tp, sequence_parallel)

    def vocab_rows(self, tp: int = 1, sequence_parallel: bool = False) -> int:
        """Rows of the embedding (and of the head) one TP rank holds: its share of the padded
        vocabulary, or the whole real one when it is not split."""
        if self.splits_vocab(tp, sequence_parallel):
            return self.padded_vocab(tp) // tp
        return self.vocab

    # ---- parameter counts -------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one block (attention + MLP + two norms)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        attn = h * (h + 2 * kv) + h * h  # QKV (h, h + 2 kv) and out-proj (h, h)
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * (2 * h if self.biases else h)
        if self.biases:
            attn += (h + 2 * kv) + h
            mlp += f + h
        return attn + mlp + norms

    def embedding_params(self, tp: int = 1) -> int:
        """Input embedding (padded) plus positions, before any TP split."""
        pos = self.seq_len * self.hidden if self.learned_positions else 0
        return self.padded_vocab(tp) * self.hidden + pos

    def head_params(self, tp: int = 1) -> int:
        """Final norm plus the output projection when it is not tied."""
        norm = 2 * self.hidden if self.biases else self.hidden
        return norm + (0 if self.tied_embeddings else self.padded_vocab(tp) * self.hidden)

    def params(self) -> int:
        """Total parameters (vocabulary padded for tp=1)."""
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    # ---- FLOPs ------------------------------------------------------------------------
    def layer_flops_fwd(self, tokens: int) -> tuple[float, float]:
        """Forward FLOPs of one block for ``tokens`` = b*s tokens: (GEMMs, attention core).

        GEMMs: 2 * tokens * (weights of QKV, out-proj, MLP). Attention core: QK^T and
        softmax(.)V, each 2*b*s*s*h (full square, as Megatron counts it).
        """
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        weights = h * (h + 2 * kv) + h * h + (3 if self.gated_mlp else 2) * h * f
        core = 4.0 * tokens * self.seq_len * h
        return 2.0 * tokens * weights, core

    def logits_flops_fwd(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.padded_vocab()

    def model_flops_per_step(self) -> float:
        """Model FLOPs of one step (forward + backward = 3x forward, no recompute)."""
        tokens = self.global_batch * self.seq_len
        gemm, core = self.layer_flops_fwd(tokens)
        return 3.0 * (self.layers * (gemm + core) + self.logits_flops_fwd(tokens))

    def with_(self, **kw) -> ModelShape:
        return replace(self, **kw)


_MEGATRON21 = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
    "Clusters Using Megatron-LM', Table 1 (arXiv:2104.04473)"
)
_LLAMA2 = "Touvron et al. 2023, 'Llama 2: Open Foundation and Fine-Tuned Chat Models', Table 1/A"
_GPT2 = "Radford et al. 2019, GPT-2 model sizes (12/24/36/48 layers)"

PRESETS: dict[str, ModelShape] = {
    "gpt3-175b": ModelShape(
        "gpt3-175b", 96, 12288, 96, 4 * 12288, 51200, 2048, 1536, dropout=True, source=_MEGATRON21
    ),
    "gpt-1.7b": ModelShape(
        "gpt-1.7b", 24, 2304, 24, 4 * 2304, 51200, 2048, 512, dropout=True, source=_MEGATRON21
    ),
    "gpt-1t": ModelShape(
        "gpt-1t", 128, 25600, 160, 4 * 25600, 51200, 2048, 3072, dropout=True, source=_MEGATRON21
    ),
    "llama2-7b": ModelShape(
        "llama2-7b",
        32,
        4096,
        32,
        11008,
        32000,
        4096,
        1024,
        gated_mlp=True,
        learned_positions=False,
        tied_embeddings=False,
        biases=False,
        source=_LLAMA2 + " (4M-token batch = 1024 x 4096)",
    ),
    "llama2-70b": ModelShape(
        "llama2-70b",
        80,
        8192,
        64,
        28672,
        32000,
        4096,
        1024,
        kv_heads=8,
        gated_mlp=True,
        learned_positions=False,
        tied_embeddings=False,
        biases=False,
        source=_LLAMA2 + " (4M-token batch = 1024 x 4096)",
    ),
}

# Fallback copies of distllm.models.GPTConfig's presets (tiny: byte vocabulary of 256;
# gpt2-*: the GPT-2 vocabulary), used only when distllm.models cannot be imported;
# otherwise preset() reads GPTConfig itself.
_GPT_LOCAL = {
    "tiny": (4, 128, 4, 512, 256, 128, 32),
    "gpt2-small": (12, 768, 12, 3072, 50257, 1024, 32),
    "gpt2-medium": (24, 1024, 16, 4096, 50257, 1024, 32),
    "gpt2-xl": (48, 1600, 25, 6400, 50257, 1024, 32),
}
for _n, (_l, _h, _a, _f, _v, _s, _b) in _GPT_LOCAL.items():
    PRESETS[_n] = ModelShape(
        _n,
        _l,
        _h,
        _a,
        _f,
        _v,
        _s,
        _b,
        tied_embeddings=False,
        source=f"distllm.models.GPTConfig.preset({_n!r})",
    )


def preset_names() -> list[str]:
    return sorted(PRESETS)


def _from_gptconfig(name: str) -> ModelShape | None:
    """The shape of ``distllm.models.GPTConfig``'s preset ``name``, if that module exists."""
    try:
        from distllm.models import GPTConfig  # lazy: pulls in torch
    except Exception:  # noqa: BLE001 - any failure means: use the mirrored numbers
        return None
    try:
        make = getattr(GPTConfig, "preset", None) or getattr(GPTConfig, "from_preset", None)
        cfg = make(name) if make else GPTConfig.presets()[name]
    except Exception:  # noqa: BLE001
        return None

    def pick(*names, default=None):
        for n in names:
            if hasattr(cfg, n):
                return getattr(cfg, n)
        return default

    base = PRESETS[name]
    try:
        return replace(
            base,
            layers=int(pick("n_layers", "n_layer", "num_layers", "layers", default=base.layers)),
            hidden=int(pick("hidden", "hidden_size", "n_embd", "d_model", default=base.hidden)),
            heads=int(pick("n_heads", "n_head", "num_heads", "heads", default=base.heads)),
            ffn=int(pick("ffn_hidden_size", "ffn", "intermediate_size", default=base.ffn)),
            kv_heads=int(pick("n_kv_heads", "kv_heads", default=0) or 0),
            vocab=int(pick("vocab_size", "vocab", default=base.vocab)),
            seq_len=int(
                pick(
                    "seq_len",
                    "max_seq_len",
                    "n_positions",
                    "block_size",
                    "context_length",
                    default=base.seq_len,
                )
            ),
            tied_embeddings=bool(
                pick(
                    "tie_embeddings",
                    "tied_embeddings",
                    "tie_word_embeddings",
                    default=base.tied_embeddings,
                )
            ),
            dropout=bool(pick("dropout", default=0.0)),
        )
    except (TypeError, ValueError):
        return None


def preset(name: str) -> ModelShape:
    """A preset shape by name (``tiny``, ``gpt2-small``, ``gpt3-175b``, ``llama2-70b``, ...)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}: choose one of {', '.join(preset_names())}"
            " or give --layers --hidden --heads --ffn --vocab --seq-len"
        )
    if key in _GPT_LOCAL:
        got = _from_gptconfig(key)
        if got is not None:
            return got
    return PRESETS[key]
