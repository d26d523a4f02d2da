"""The variants of one ``train_e2e`` training step, each built as a step function.

distllm's step (``Engine.forward_backward`` then ``Engine.update``: one host read per step)
and its torch peers on a dense GPT of the same shape built from torch blocks: DTensor
``parallelize_module`` for ``tp2``, ``DistributedDataParallel`` for ``dp2``, and with FSDP2
``fully_shard`` for ``dp2.zero2``, ``torch.distributed.pipelining`` 1F1B for ``pp2.1f1b``; each with
global-norm clipping and torch's fused AdamW (``fused=True``, as distllm's engine runs it),
so that the optimizer costs the same on both sides. :func:`builders` gives one layout's
variants, unbuilt; :mod:`distllm.bench.train_e2e` times and reports them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["builders", "distllm_single", "drain"]


# --- a dense GPT of the same shape from torch blocks -------------------------------------
class _Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)  # local heads under TP
        q, k, v = (t.reshape(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate="tanh"))


class _Embed(nn.Module):
    def __init__(self, vocab: int, h: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Parameter(torch.zeros(seq, h))

    def forward(self, t):
        return self.wte(t) + self.wpe[: t.shape[1]]


class _Head(nn.Module):
    def __init__(self, vocab: int, h: int):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def _dense_layers(cfg) -> list[nn.Module]:
    torch.manual_seed(0)
    return ([_Embed(cfg.vocab_size, cfg.hidden_size, cfg.max_seq_len)]
            + [_Block(cfg.hidden_size, cfg.n_heads, cfg.ffn_hidden_size)
               for _ in range(cfg.n_layers)] + [_Head(cfg.vocab_size, cfg.hidden_size)])


def _ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _adamw(params):
    """torch's fused AdamW; DTensor and plain parameters in separate groups (one fused call
    takes one kind)."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    kinds = [[p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": ps} for ps in kinds if ps], lr=1e-4, fused=True)


# --- variants: each returns a step function ----------------------------------------------
def _distllm(layout: str, cfg, batch, seq, m, dims):
    from distllm.train.config import ParallelConfig, TrainConfig
    from distllm.train.engine import Engine

    kw = {"tp2": dict(tp=2), "dp2": dict(dp=2), "dp2.zero2": dict(dp=2, zero=2),
          "pp2.1f1b": dict(pp=2, schedule="1f1b", micro_batches=m)}[layout]
    tc = TrainConfig(model="tiny", parallel=ParallelConfig(**kw), global_batch=batch,
                     seq_len=seq, steps=10, progress=False)
    eng = Engine(tc, cfg, dims)
    x = torch.randint(0, cfg.vocab_size, (batch // dims.dp, seq),
                      generator=torch.Generator().manual_seed(1 + dims.dp_rank))
    return _engine_step(eng, x)


def _engine_step(eng, x):
    """A training loop's step: forward + backward, then clip + AdamW, one host read."""
    def step():
        eng.update(1.0, eng.forward_backward(x, x))

    step.engine = eng  # finish() waits for what a step leaves in flight (ZeRO's gathers)
    return step


def _torch_tp(cfg, batch, seq, dims):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(*_dense_layers(cfg))
    for blk in list(model)[1:-1]:
        parallelize_module(blk, mesh, {"qkv": ColwiseParallel(), "o": RowwiseParallel(),
                                       "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = _adamw(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        _ce(model(x), x).backward()
        _clip_tp(list(model.parameters()), 1.0)
        opt.step()

    return step


@torch.no_grad()
def _clip_tp(params, max_norm: float) -> None:
    """Global-norm clipping over DTensor (sharded) and plain (replicated) gradients, as a
    torch user writes it (``clip_grad_norm_`` refuses the mix): torch's own norm of each set
    in the gradients' dtype, one all-reduce of the sharded squares, one host read."""
    from torch.distributed.tensor import DTensor, Shard

    sharded, rep = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            is_shard = any(isinstance(pl, Shard) for pl in g.placements)
            (sharded if is_shard else rep).append(g.to_local())
        else:
            rep.append(g)
    sq = torch.nn.utils.get_total_norm(sharded) ** 2
    dist.all_reduce(sq)
    total = float(sq + torch.nn.utils.get_total_norm(rep) ** 2) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(sharded + rep, coef)


@torch.no_grad()
def _clip_pp(params, max_norm: float, group) -> None:
    """Global-norm clipping across pipeline stages, as torchtitan does it: each stage's norm,
    its square all-reduced over the pipeline group, then torch's clip with that norm."""
    params = [p for p in params if p.grad is not None]
    sq = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
    dist.all_reduce(sq, group=group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt())


def _torch_dp(kind: str, cfg, batch, seq, dims):
    model = nn.Sequential(*_dense_layers(cfg))
    if kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = _adamw(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch // 2, seq),
                      generator=torch.Generator().manual_seed(1 + dims.rank))

    def step():
        opt.zero_grad()
        _ce(wrapped(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def _torch_pp(cfg, batch, seq, m, dims):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    layers = _dense_layers(cfg)
    half = (len(layers) + 1) // 2
    mine = nn.Sequential(*(layers[:half] if dims.pp_rank == 0 else layers[half:]))
    stage = PipelineStage(mine, dims.pp_rank, 2, torch.device("cpu"), group=dims.pp_group)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=_ce)
    opt = _adamw(mine.parameters())
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        if dims.pp_rank == 0:
            sched.step(x)
        else:
            sched.step(target=x, losses=[])
        _clip_pp(mine.parameters(), 1.0, dims.pp_group)
        opt.step()

    return step


def builders(layout: str, gcfg, shape: tuple[int, ...], dims) -> dict[str, Callable]:
    """Variant name -> a function that builds its step, for ``layout`` (``tp2``, ``dp2``,
    ``dp2.zero2`` or ``pp2.1f1b``) at ``shape`` ``(blocks, hidden, batch, seq, micro-batches)``
    of the model ``gcfg``: distllm first, then its torch peers."""
    _, _, batch, seq, m = shape
    out = {"distllm": lambda: _distllm(layout, gcfg, batch, seq, m, dims)}
    if layout == "tp2":
        out["torch_dtensor_tp"] = lambda: _torch_tp(gcfg, batch, seq, dims)
    elif layout == "dp2":
        out["torch_ddp"] = lambda: _torch_dp("ddp", gcfg, batch, seq, dims)
    elif layout == "dp2.zero2":
        out["torch_ddp"] = lambda: _torch_dp("ddp", gcfg, batch, seq, dims)
        out["torch_fsdp2_zero2"] = lambda: _torch_dp("fsdp2", gcfg, batch, seq, dims)
    else:
        out["torch_pipelining_1f1b"] = lambda: _torch_pp(gcfg, batch, seq, m, dims)
    return out


def distllm_single(cfg, batch: int, seq: int, dims) -> Callable[[], None]:
    """distllm's step of the model ``cfg`` on one rank (tp1.pp1.dp1)."""
    from distllm.train.config import TrainConfig
    from distllm.train.engine import Engine

    tc = TrainConfig(model="tiny", global_batch=batch, seq_len=seq, steps=10, progress=False)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return _engine_step(Engine(tc, cfg, dims), x)


def drain(step: Callable) -> Callable[[], object] | None:
    """What waits for the work a variant's step leaves in flight (ZeRO's gathers), or None."""
    eng = getattr(step, "engine", None)
    return eng.zero.wait_params if eng is not None and eng.zero is not None else None
