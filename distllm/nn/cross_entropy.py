"""``vocab_parallel_cross_entropy``: cross-entropy over logits split along the vocabulary,
numerically stable, without ever gathering the full logits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distllm.comm.collectives import all_reduce
from distllm.nn.embedding import check_ids_in_vocab
from distllm.parallel.tensor.mappings import differentiable_once

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``log(sum_v exp(z_v - m)) - (z_t - m)``, ``m`` the global max.

    Collectives: forward an all-reduce (MAX) of the per-token local max and one all-reduce
    (SUM) of the stacked per-token ``sum exp`` and target logit; backward none (the
    gradient ``softmax - onehot`` is local to each vocabulary shard).
    """

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        vl = logits.shape[-1]
        start = dist.get_rank(group) * vl
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        m = z.max(dim=-1).values  # (...,)
        all_reduce(m, group=group, op=dist.ReduceOp.MAX)
        e = (z - m.unsqueeze(-1)).exp_()  # (..., V/tp), <= 1
        local_t = targets - start
        inside = (local_t >= 0) & (local_t < vl)
        idx = local_t.clamp(0, vl - 1).unsqueeze(-1)
        # target logit - m, or 0 (where, not a product: the clamped index may point at a -inf
        # logit, the vocabulary's padding or a masked token, and -inf * 0 is NaN)
        picked = torch.where(inside, z.gather(-1, idx).squeeze(-1) - m, 0.0)
        sums = torch.stack([e.sum(-1), picked])  # (2, ...)
        all_reduce(sums, group=group)
        valid = targets != ignore_index
        loss = torch.where(valid, sums[0].log() - sums[1], 0.0)
        e.div_(sums[0].unsqueeze(-1))  # softmax of this shard
        ctx.save_for_backward(e, idx, inside, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        p, idx, inside, valid = ctx.saved_tensors
        grad = p.clone()
        grad.scatter_add_(-1, idx, -inside.to(grad.dtype).unsqueeze(-1))  # softmax - onehot
        grad.mul_((g * valid).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, dims,
                                 ignore_index: int = -100, reduction: str = "mean"
                                 ) -> torch.Tensor:
    """Cross-entropy of logits whose last dim is this rank's ``V/tp`` vocabulary slice (rank
    ``r`` holds ``[r*V/tp, (r+1)*V/tp)``, as ``ColumnParallelLinear`` /
    ``VocabParallelEmbedding`` shard it); ``targets`` hold global token ids, the same on
    every tp rank. Equals ``F.cross_entropy`` of the gathered logits: tokens equal to
    ``ignore_index`` count zero and are left out of the mean, any other target outside
    ``[0, V)`` is an error (a ValueError on CPU); ``reduction`` is "mean",
    "sum" or "none" (per token). fp16/bf16 logits are reduced in float32 and the loss is
    float32. Collectives: see ``_VocabParallelCrossEntropy``; with tp=1 none.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {_REDUCTIONS}")
    if targets.shape != logits_local.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits_local.shape)} without their last (vocabulary) dim")
    vocab = logits_local.shape[-1] * dims.tp
    check_ids_in_vocab(targets, vocab, "vocab_parallel_cross_entropy: targets", ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits_local, targets, dims.tp_group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count, total = (targets != ignore_index).sum(), loss.sum()
    # every token ignored: F.cross_entropy's NaN loss, with its zero gradient (0/0 would send
    # NaN into every logit's); no host sync
    return torch.where(count > 0, total / count.clamp(min=1), total.new_tensor(float("nan")))
