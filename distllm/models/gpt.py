"""GPT-2, built only from ``distllm.nn`` modules, as a list of layers that a pipeline splits.

Layer ``0`` is the embedding (vocab-parallel token embedding + learned positions), layers
``1..L`` are pre-LayerNorm transformer blocks (``ParallelAttention``, ``ParallelMLP`` with the
fused column-parallel GEMM + GeLU), layer ``L+1`` is the head (final LayerNorm, vocab-parallel
output projection). The loss is :func:`distllm.nn.vocab_parallel_cross_entropy`, which never
gathers the full logits.

A small vocabulary is not split (``vocab_parallel="auto"``, see :func:`splits_vocab`): the
embedding and the head are then held whole by every TP rank, as the layer norms are, and
cost no collective at all (a split one costs an all-reduce of the embedding's output in
forward, two small ones in the cross-entropy and one of the head's input gradient in
backward).

Every layer has *canonical* weights: full (unsharded) tensors with global names such as
``layers.3.attn.qkv.weight``, laid out like ``nn.Linear`` (``(out, in)``), the vocabulary cut
to its real size. Initialisation, checkpoints (:mod:`distllm.train.checkpoint`) and Hugging
Face conversion (:mod:`distllm.models.hf`) all go through them
(:mod:`distllm.models.sharding`), so every layout (tp, pp, dp, ZeRO) starts from the same
weights and a checkpoint saved at one layout loads at any other.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable

import torch
from torch import nn

from distllm.models.config import CHECKPOINTING, PRESETS, VOCAB_PARALLEL, GPTConfig
from distllm.nn.precision import Embedding as TableEmbedding
from distllm.nn.precision import LayerNorm
from distllm.parallel.mesh import ParallelDims
from distllm.parallel.tensor.batch_split import split_parts, split_residual

__all__ = ["GPTConfig", "GPT", "Embedding", "Block", "Head", "PRESETS", "CHECKPOINTING",
           "VOCAB_PARALLEL", "splits_vocab", "check_vocab_parallel", "check_batch_split",
           "check_layer_ids"]


def splits_vocab(vocab: int, hidden: int, tp: int, sequence_parallel: bool = False,
                 choice: str = "auto") -> bool:
    """Whether the embedding and the head split a vocabulary of ``vocab`` tokens over ``tp``
    ranks (``vocab_parallel=choice``). One rank: True (the split modules, whole).

    ``"auto"`` holds them whole when ``vocab * (tp - 1) <= 2 * hidden``. Per rank, a block
    costs ``24Th^2/tp`` FLOPs for ``T`` tokens and holds ``12h^2/tp`` weights; computing the
    head whole instead of its ``1/tp`` share costs ``6TVh(1 - 1/tp)`` FLOPs forward and
    backward, at most half a block's, and holding the table whole at most ``2h^2/tp`` more
    weights (and their optimizer state), a sixth of a block's. The split costs an activation
    all-reduce in the embedding's forward and in the head's backward, plus two
    latency-bound ones in the cross-entropy. Sequence parallelism keeps the split (its
    activations are sharded along the sequence there)."""
    check_vocab_parallel(choice, tp, sequence_parallel)
    if tp == 1 or choice == "on" or sequence_parallel:
        return True
    return choice == "auto" and vocab * (tp - 1) > 2 * hidden


def check_vocab_parallel(choice: str, tp: int, sequence_parallel: bool) -> None:
    """A ValueError naming the knob when ``vocab_parallel=choice`` is not one of
    :data:`VOCAB_PARALLEL`, or asks for the whole vocabulary under sequence parallelism."""
    if choice not in VOCAB_PARALLEL:
        raise ValueError(f"vocab_parallel={choice!r}: choose one of {', '.join(VOCAB_PARALLEL)}")
    if choice == "off" and sequence_parallel and tp > 1:
        raise ValueError("vocab_parallel='off' holds the embedding and the head whole, which "
                         "sequence parallelism does not support: use --vocab-parallel auto "
                         "(or on), or drop --sequence-parallel")


def _layer_norm(cfg: GPTConfig, dims: ParallelDims, sp: bool, dtype) -> nn.Module:
    """LayerNorm; under sequence parallelism, the one that all-reduces its grads over TP."""
    if sp and dims.tp > 1:
        from distllm.nn import ParallelLayerNorm

        return ParallelLayerNorm(cfg.hidden_size, dims, eps=cfg.layer_norm_eps,
                                 sequence_parallel=True, dtype=dtype)
    return LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)


class Embedding(nn.Module):
    """Token embedding plus learned positions.

    Collectives: forward all-reduce of the vocab-parallel lookup over TP (sequence
    parallelism: reduce-scatter along the sequence, so the output is this rank's ``(b, s/tp,
    h)`` slice); backward none (sequence parallelism: all-gather of the gradient along the
    sequence, and an all-reduce of the position embedding's gradient over TP). With
    ``vocab_parallel=False`` the table is whole (``nn.Embedding``) on every TP rank: no
    collective (the gradient flowing into it is the same on every TP rank).
    """

    def __init__(self, cfg: GPTConfig, dims: ParallelDims, *, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, vocab_parallel: bool = True):
        super().__init__()
        from distllm.nn import VocabParallelEmbedding

        self.cfg, self.dims, self.sp = cfg, dims, sequence_parallel and dims.tp > 1
        if vocab_parallel:
            self.wte = VocabParallelEmbedding(cfg.padded_vocab(dims.tp), cfg.hidden_size, dims,
                                              sequence_parallel=self.sp, dtype=dtype,
                                              num_ids=cfg.vocab_size)
        elif self.sp:
            raise ValueError("Embedding(vocab_parallel=False) does not support sequence "
                             "parallelism")
        else:
            self.wte = TableEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.wpe = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.hidden_size, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"GPT takes (batch, seq) token ids, got shape {tuple(tokens.shape)}"
                             f": for one sequence pass tokens.unsqueeze(0)")
        s = tokens.shape[1]
        if s > self.cfg.max_seq_len:  # (sequence parallelism would reuse the last position)
            raise ValueError(f"GPT: a sequence of {s} tokens is longer than max_seq_len="
                             f"{self.cfg.max_seq_len} positions: shorten the input, or build "
                             f"the model with a larger max_seq_len")
        x = self.wte(tokens)  # (b, s, h), or (b, s/tp, h) under sequence parallelism
        if not self.sp:
            return x + self.wpe[:s]  # (b, s, h) + (s, h)
        from distllm.parallel.tensor.mappings import sync_grad_over_tp

        per = s // self.dims.tp
        wpe = sync_grad_over_tp(self.wpe, self.dims.tp_group)  # this rank's positions only
        return x + wpe[self.dims.tp_rank * per:(self.dims.tp_rank + 1) * per]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).

    Collectives: one all-reduce (or reduce-scatter + all-gather with sequence parallelism)
    in the attention's output projection and one in the MLP's, in forward; the same number
    in backward, in the column-parallel input projections.
    """

    def __init__(self, cfg: GPTConfig, dims: ParallelDims, *, sequence_parallel: bool = False,
                 overlap: str = "auto", checkpointing: str = "none",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        from distllm.nn import ParallelAttention, ParallelMLP

        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={checkpointing!r}: choose one of "
                             f"{', '.join(CHECKPOINTING)}")
        sp = sequence_parallel and dims.tp > 1
        self.checkpointing = checkpointing
        self.ln_1 = _layer_norm(cfg, dims, sp, dtype)
        self.attn = ParallelAttention(cfg.hidden_size, cfg.n_heads, dims,
                                      n_kv_heads=cfg.n_kv_heads, bias=True,
                                      sequence_parallel=sp, overlap=overlap, dtype=dtype)
        self.ln_2 = _layer_norm(cfg, dims, sp, dtype)
        self.mlp = ParallelMLP(cfg.hidden_size, cfg.ffn_hidden_size, dims,
                               activation=cfg.activation, bias=True, sequence_parallel=sp,
                               overlap=overlap, dtype=dtype)
        self.attn.recompute_core = checkpointing == "selective"

    def attn_branch(self, x: torch.Tensor) -> torch.Tensor:
        """``attn(ln_1(x))``: what the block adds to the residual stream first."""
        return self.attn(self.ln_1(x))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp(ln_2(x))``: what the block adds to the residual stream second."""
        return self.mlp(self.ln_2(x))

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn_branch(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp_branch(x)

    def splittable(self) -> bool:
        """Whether batch-split overlap may run this block branch by branch: no activation
        checkpointing while grad is on, and no module hooks (ZeRO's parameter gathers wait
        in a block's forward pre-hook: calling its branches would skip them)."""
        if self.checkpointing != "none" and torch.is_grad_enabled():
            return False
        return not (self._forward_pre_hooks or self._forward_hooks or self._backward_hooks
                    or self._backward_pre_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # selective: the attention recomputes its core (softmax(QK^T)V) in backward from the
        # Q, K, V it keeps, as Megatron-LM's selective recomputation (Korthikanti et al.
        # 2022): the scores are the big activation, the GEMMs the costly recompute
        if self.checkpointing != "full" or not torch.is_grad_enabled():
            return self._mlp(self._attn(x))
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: self._mlp(self._attn(t)), x, use_reentrant=False)


class Head(nn.Module):
    """Final LayerNorm and the vocab-parallel output projection; returns this rank's logits
    ``(b, s, V_pad/tp)`` (padded vocabulary entries masked to -inf). With sequence parallelism
    the column-parallel projection all-gathers the sequence in forward (reduce-scatters its
    gradient in backward); without it, it all-reduces the input gradient in backward. With
    ``vocab_parallel=False`` the projection is whole (``nn.Linear``) on every TP rank and
    returns the full logits ``(b, s, V)``: no collective."""

    def __init__(self, cfg: GPTConfig, dims: ParallelDims, *, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, vocab_parallel: bool = True):
        super().__init__()
        from distllm.nn import ColumnParallelLinear

        sp = sequence_parallel and dims.tp > 1
        self.cfg, self.dims = cfg, dims
        self.ln_f = _layer_norm(cfg, dims, sp, dtype)
        if not vocab_parallel:
            if sp:
                raise ValueError("Head(vocab_parallel=False) does not support sequence "
                                 "parallelism")
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            self.has_pad = False
            return
        vp = cfg.padded_vocab(dims.tp)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, vp, dims, bias=False,
                                            gather_output=False, sequence_parallel=sp,
                                            dtype=dtype)
        per = vp // dims.tp
        lo = dims.tp_rank * per
        # (V_pad/tp,), on the default device; on the CPU where that is the meta device (a
        # model built for ZeRO-3's deferred initialisation materialises parameters only:
        # :class:`~distllm.parallel.data.zero3.ShardedParams`)
        dev = torch.empty(0).device
        pad = torch.arange(lo, lo + per, device="cpu" if dev.type == "meta" else dev) \
            >= cfg.vocab_size
        self.register_buffer("pad_mask", pad, persistent=False)
        self.has_pad = lo + per > cfg.vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))  # (b, s, h) @ (h, V/tp) -> (b, s, V/tp)
        if self.has_pad:
            logits = logits.masked_fill(self.pad_mask, float("-inf"))
        return logits


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, dims: ParallelDims,
             vocab_parallel: bool = True, vocab: int | None = None) -> torch.Tensor:
    """Mean token cross-entropy of vocab-parallel logits (all-reduces of max, sum-exp and the
    target logit over TP in forward; none in backward). With tp=1, or the full logits of a
    head that does not split the vocabulary (``vocab_parallel=False``), it is the plain
    ``F.cross_entropy`` (no collective). ``vocab``: the real vocabulary, where the logits'
    is padded past it: a target in the padding is an error (its logit is -inf), as one past
    the logits is."""
    if vocab is not None and vocab < logits.shape[-1] * (dims.tp if vocab_parallel else 1):
        from distllm.nn.embedding import check_ids_in_vocab

        check_ids_in_vocab(targets, vocab, "GPT: targets", ignore_index=-100)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # the softmax in fp32
    if dims.tp == 1 or not vocab_parallel:
        import torch.nn.functional as F

        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    from distllm.nn import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets, dims)


class GPT(nn.Module):
    """The layers of a GPT that this rank holds, keyed by their global index.

    ``layer_ids`` selects them (``None``: all, for pp=1). ``forward(tokens)`` runs the held
    layers in order; :meth:`loss` applies the vocab-parallel cross-entropy. Weights are
    initialised from ``seed`` layer by layer on the canonical (unsharded) shapes, so every
    layout holds the same model. ``vocab_parallel`` (:data:`VOCAB_PARALLEL`): whether the
    embedding and the head split the vocabulary over TP; the resolved choice is
    :attr:`vocab_parallel` (a bool, see :func:`splits_vocab`). ``batch_split``: the parts of
    the batch that runs of consecutive blocks process in turn under tensor parallelism, each
    part's row-parallel all-reduces hidden behind the next part's compute
    (:mod:`distllm.parallel.tensor.batch_split`). ``"auto"`` splits in 2 a forward that
    no backward follows (evaluation, inference) on CPU and nothing else: in training each
    part's backward computes its own weight gradients, which autograd then adds, and on 2 CPU
    ranks that cost more than the forward gained (see the module); on CUDA it is not measured
    yet. An integer forces the parts, 1 turns it off. A block with module hooks (ZeRO's
    parameter gathers) or activation checkpointing runs whole (:meth:`Block.splittable`).
    Inside a split block a row-parallel layer returns its partial sum, without the bias, and
    the sum is taken later: a forward hook on that layer, or on the attention or MLP that
    ends with it, sees the partial sum (the overlap doctor reads such a layer as
    ``deferred``); ``batch_split=1`` runs every hook on whole sums.
    """

    def __init__(self, cfg: GPTConfig, dims: ParallelDims, *,
                 layer_ids: Iterable[int] | None = None,
                 sequence_parallel: bool = False, overlap: str = "auto",
                 activation_checkpointing: str = "none", dtype: torch.dtype = torch.float32,
                 seed: int | None = 0, vocab_parallel: str = "auto",
                 batch_split: int | str = "auto"):
        super().__init__()
        if cfg.tie_embeddings and dims.pp > 1:
            raise ValueError("tie_embeddings=True needs pp=1 (the embedding and the head live "
                             "on different stages): untie them or use --pp 1")
        self.cfg, self.dims, self.dtype = cfg, dims, dtype
        self.sequence_parallel = sequence_parallel and dims.tp > 1
        self.batch_split = check_batch_split(batch_split, dims.tp, self.sequence_parallel,
                                             overlap)
        self.vocab_parallel = splits_vocab(cfg.vocab_size, cfg.hidden_size, dims.tp,
                                           self.sequence_parallel, vocab_parallel)
        ids = (list(range(cfg.n_pipeline_layers)) if layer_ids is None
               else check_layer_ids(layer_ids, cfg.n_layers))
        self.layer_ids = ids
        kw = dict(sequence_parallel=sequence_parallel, dtype=dtype)
        layers = {}
        for i in ids:
            if i == 0:
                layers[str(i)] = Embedding(cfg, dims, vocab_parallel=self.vocab_parallel, **kw)
            elif i == cfg.n_layers + 1:
                layers[str(i)] = Head(cfg, dims, vocab_parallel=self.vocab_parallel, **kw)
            else:
                layers[str(i)] = Block(cfg, dims, overlap=overlap,
                                       checkpointing=activation_checkpointing, **kw)
        self.layers = nn.ModuleDict(layers)
        if cfg.tie_embeddings and 0 in ids and cfg.n_layers + 1 in ids:
            self.layers[str(cfg.n_layers + 1)].lm_head.weight = self.layers["0"].wte.weight
        if seed is not None:
            self.reset_parameters(seed)

    def layer_list(self) -> list[nn.Module]:
        return [self.layers[str(i)] for i in self.layer_ids]

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        from distllm.models.sharding import init_canonical, load_layer

        for i in self.layer_ids:
            load_layer(self, i, init_canonical(self.cfg, i, seed, self.dtype))

    def split_parts(self, x: torch.Tensor) -> int:
        """How many parts of the batch ``x`` (its dim 0) the blocks run in: the resolved
        :attr:`batch_split` (``"auto"``: 2 for a forward without autograd on CPU, else 1; see
        the class docstring), 1 without TP."""
        n = self.batch_split
        if n == "auto":
            n = 2 if x.device.type == "cpu" and not torch.is_grad_enabled() else 1
        return split_parts(x.shape[0], n)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        # runs of consecutive blocks that batch-split overlap can run, and the other layers
        for splittable, run in itertools.groupby(
                self.layer_list(), key=lambda m: isinstance(m, Block) and m.splittable()):
            run = list(run)
            if splittable and (parts := self.split_parts(x)) > 1:
                x = split_residual([f for b in run for f in (b.attn_branch, b.mlp_branch)],
                                   x, parts)
                continue
            for layer in run:
                x = layer(x)
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(logits, targets, self.dims, self.vocab_parallel, self.cfg.vocab_size)


def check_layer_ids(layer_ids: Iterable[int], n_layers: int) -> list[int]:
    """``layer_ids`` as a list of ints after checking them: each a layer of a model of
    ``n_layers`` blocks (0 the embedding, 1..n_layers the blocks, n_layers + 1 the head),
    each once, in increasing order (the order :meth:`GPT.forward` runs them in). ValueError
    naming ``layer_ids`` otherwise."""
    given = list(layer_ids)
    if not all(map(_whole, given)):
        raise ValueError(f"layer_ids={given!r}: each must be a whole number (0 the embedding, "
                         f"1..{n_layers} the blocks, {n_layers + 1} the head)")
    ids = [operator.index(i) for i in given]
    if any(i < 0 or i > n_layers + 1 for i in ids):
        out = [i for i in ids if i < 0 or i > n_layers + 1]
        raise ValueError(f"layer_ids={ids!r}: {', '.join(map(str, out))} out of range: a "
                         f"model of {n_layers} blocks has layers 0 (the embedding), "
                         f"1..{n_layers} (the blocks) and {n_layers + 1} (the head)")
    if any(a >= b for a, b in itertools.pairwise(ids)):
        raise ValueError(f"layer_ids={ids!r}: give each layer once, in increasing order (the "
                         f"order the model runs them in)")
    return ids


def _whole(i) -> bool:
    """Whether ``i`` is an integer (an int or another integer type, not a bool)."""
    if isinstance(i, bool):
        return False
    try:
        operator.index(i)
    except TypeError:
        return False
    return True


def check_batch_split(batch_split: int | str, tp: int, sequence_parallel: bool,
                      overlap: str) -> int | str:
    """The :class:`GPT`'s ``batch_split`` after checking it: ``"auto"`` stays ``"auto"``
    where batch-split overlap applies (tensor parallelism without sequence parallelism, and
    ``overlap`` not ``"none"``), else 1; an integer of at least 1 stays (1 where it cannot
    apply). See :mod:`distllm.parallel.tensor.batch_split`."""
    if batch_split != "auto" and (isinstance(batch_split, bool)
                                  or not isinstance(batch_split, int) or batch_split < 1):
        raise ValueError(f"batch_split={batch_split!r}: use 'auto' or a whole number >= 1 "
                         "(1 turns batch-split overlap off)")
    if tp == 1 or sequence_parallel:
        return 1
    if batch_split == "auto" and overlap == "none":
        return 1
    return batch_split


def residual_std(cfg: GPTConfig) -> float:
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)
