"""Canonical (unsharded) weights of the GPT layers, and their mapping to the TP shards.

A layer's canonical weights are full tensors named like ``attn.qkv.weight`` (``nn.Linear``
layout ``(out, in)``; QKV rows ordered ``[q heads; k heads; v heads]``; the vocabulary cut to
its real size). :func:`load_layer` shards them into a layer's modules for this rank's TP
position; :func:`gather_layer` collects them back (an all-gather over the TP group per
sharded tensor); :func:`tp_pieces` says where each part of a rank's shard sits in the
canonical tensor, with no collective (checkpoints write and read those parts alone).
Initialisation and Hugging Face conversion use the first two.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from distllm.parallel.mesh import ParallelDims

__all__ = ["canonical_shapes", "init_canonical", "init_params", "load_layer", "gather_layer",
           "flat_pieces", "layer_kind", "module_paths", "param_table", "shard_full", "tp_pieces",
           "unshard"]

# canonical name -> (path in the layer module, how it is split over TP)
#   "col": rows split (column-parallel out features); "row": columns split; "rep": replicated;
#   "vocab": rows split after padding the vocabulary; "qkv": heads split within q, k and v.
_BLOCK = {
    "ln_1.weight": ("ln_1.weight", "rep"), "ln_1.bias": ("ln_1.bias", "rep"),
    "attn.qkv.weight": ("attn.qkv.weight", "qkv"), "attn.qkv.bias": ("attn.qkv.bias", "qkv"),
    "attn.proj.weight": ("attn.o.weight", "row"), "attn.proj.bias": ("attn.o.bias", "rep"),
    "ln_2.weight": ("ln_2.weight", "rep"), "ln_2.bias": ("ln_2.bias", "rep"),
    "mlp.fc.weight": ("mlp.fc1.weight", "col"), "mlp.fc.bias": ("mlp.fc1.bias", "col"),
    "mlp.proj.weight": ("mlp.fc2.weight", "row"), "mlp.proj.bias": ("mlp.fc2.bias", "rep"),
}
_EMBED = {"wte.weight": ("wte.weight", "vocab"), "wpe": ("wpe", "rep")}
_HEAD = {"ln_f.weight": ("ln_f.weight", "rep"), "ln_f.bias": ("ln_f.bias", "rep"),
         "lm_head.weight": ("lm_head.weight", "vocab")}


def layer_kind(cfg, i: int) -> str:
    return "embed" if i == 0 else "head" if i == cfg.n_layers + 1 else "block"


def param_table(cfg, i: int, vocab_parallel: bool = True) -> dict[str, tuple[str, str]]:
    """Layer ``i``'s parameters: canonical name -> (path in the layer module, how it is
    split over TP: "col", "row", "vocab" or "rep"). ``vocab_parallel=False``: the embedding
    and the head hold the whole vocabulary ("rep"; :attr:`distllm.models.GPT.vocab_parallel`)."""
    kind = layer_kind(cfg, i)
    if kind == "block":
        return _BLOCK
    table = _EMBED if kind == "embed" else {
        k: v for k, v in _HEAD.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    if vocab_parallel:
        return table
    return {k: (path, "rep" if how == "vocab" else how) for k, (path, how) in table.items()}


def canonical_shapes(cfg, i: int) -> dict[str, tuple[int, ...]]:
    """Full shapes of layer ``i``'s canonical tensors."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    qkv = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes = {
        "wte.weight": (v, h), "wpe": (cfg.max_seq_len, h), "lm_head.weight": (v, h),
        "attn.qkv.weight": (qkv, h), "attn.qkv.bias": (qkv,), "attn.proj.weight": (h, h),
        "mlp.fc.weight": (f, h), "mlp.fc.bias": (f,), "mlp.proj.weight": (h, f),
    }
    return {name: shapes.get(name, (h,)) for name in param_table(cfg, i)}


def init_canonical(cfg, i: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """GPT-2 initialisation of layer ``i``, from a generator seeded by ``(seed, i)``."""
    import math

    g = torch.Generator().manual_seed(seed * 100_003 + i)
    resid = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    out = {}
    for name, shape in canonical_shapes(cfg, i).items():
        t = torch.empty(shape, dtype=torch.float64)
        if name.startswith("ln") and name.endswith("weight"):
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            std = resid if name.endswith("proj.weight") else 0.01 if name == "wpe" else cfg.init_std
            t.normal_(0.0, std, generator=g)
        out[name] = t.to(dtype)
    return out


def _get(module: nn.Module, path: str) -> torch.Tensor:
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _qkv_rows(cfg, tp: int, rank: int) -> torch.Tensor:
    """Row indices of the canonical QKV tensor held by TP rank ``rank`` (q, k, v heads)."""
    d, nq, nkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
    q = torch.arange(rank * nq // tp * d, (rank + 1) * nq // tp * d)
    kv_per = nkv // tp  # (check_heads refuses a tp that does not divide the KV heads)
    kv_lo = rank * nkv // tp * d
    k = nq * d + torch.arange(kv_lo, kv_lo + kv_per * d)
    v = k + nkv * d
    return torch.cat([q, k, v])


def shard_full(cfg, dims: ParallelDims, kind: str, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's piece of the full tensor ``full``, split as ``kind`` says."""
    tp, r = dims.tp, dims.tp_rank
    if kind == "rep" or tp == 1 and kind != "vocab":
        return full
    if kind == "vocab":
        vp = cfg.padded_vocab(tp)
        padded = torch.zeros((vp, *full.shape[1:]), dtype=full.dtype, device=full.device)
        padded[: full.shape[0]] = full
        return padded.chunk(tp, 0)[r]
    if kind == "col":
        return full.chunk(tp, 0)[r]
    if kind == "row":
        return full.chunk(tp, 1)[r]
    if kind == "qkv":
        return full[_qkv_rows(cfg, tp, r).to(full.device)]
    raise AssertionError(kind)


def _split(n: int, tp: int, r: int) -> tuple[int, int]:
    """``(start, length)`` of TP rank ``r``'s part of ``n`` as ``Tensor.chunk(tp)`` cuts it."""
    c = -(-n // tp)
    return min(r * c, n), max(0, min(c, n - r * c))


def tp_pieces(cfg, dims: ParallelDims, kind: str, shape: tuple[int, ...]
              ) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Where this TP rank's shard of a canonical tensor of ``shape``, split as ``kind`` says,
    sits in it: ``[(offsets in the canonical tensor, index of the same box in the shard)]``,
    each box a contiguous block of both (:func:`shard_full`'s inverse, with no collective).
    The vocabulary's padding rows are in no box; a "qkv" shard is three boxes (its q, k and v
    heads); every other shard is one box, and a replicated tensor is the whole of it."""
    tp, r = dims.tp, dims.tp_rank
    whole = tuple(slice(None) for _ in shape)
    zero = (0,) * len(shape)
    if kind == "rep" or tp == 1 and kind in ("col", "row", "qkv"):
        return [(zero, whole)]
    if kind == "vocab":  # rows of the padded vocabulary, cut to the real one
        start, n = _split(cfg.padded_vocab(tp), tp, r)
        n = max(0, min(n, shape[0] - start))
        return [((start, *zero[1:]), (slice(0, n), *whole[1:]))] if n else []
    if kind in ("col", "row"):
        dim = 0 if kind == "col" else 1
        start, _ = _split(shape[dim], tp, r)
        return [(tuple(start if d == dim else 0 for d in range(len(shape))), whole)]
    if kind == "qkv":  # q heads, then k, then v: three runs of _qkv_rows
        rows = _qkv_rows(cfg, tp, r).tolist()
        out, lo = [], 0
        for hi in [j for j in range(1, len(rows)) if rows[j] != rows[j - 1] + 1] + [len(rows)]:
            out.append(((rows[lo], *zero[1:]), (slice(lo, hi), *whole[1:])))
            lo = hi
        return out
    raise AssertionError(kind)


def flat_pieces(shape: tuple[int, ...], start: int, stop: int,
                pieces: list[tuple[tuple[int, ...], tuple[slice, ...]]]
                ) -> list[tuple[tuple[int, ...], int, tuple[int, ...]]]:
    """The parts of :func:`tp_pieces`' boxes ``pieces`` (of a shard shaped ``shape``, 1-D or
    2-D) that the shard's flattened elements ``[start, stop)`` hold (a ZeRO rank's part of a
    parameter): ``[(offsets in the canonical tensor, its first element in the flattened
    shard, its shape)]``. Each part is contiguous in the flattened shard: a run of whole rows,
    or a piece of one row."""
    rows, cols = shape[0], (shape[1] if len(shape) == 2 else 1)
    if len(shape) > 2 or not 0 <= start <= stop <= rows * cols:
        raise ValueError(f"flat_pieces: elements [{start}, {stop}) of a shard shaped "
                         f"{tuple(shape)} (1-D or 2-D)")
    runs = []  # (first row, first column, rows, columns, first element): the range's boxes
    at = start
    while at < stop:
        r, c = divmod(at, cols)
        n = min(cols - c, stop - at) if c or stop - at < cols else (stop - at) // cols * cols
        runs.append((r, c, 1 if c or n < cols else n // cols, min(n, cols), at))
        at += n
    out = []
    for r, c, nr, nc, first in runs:
        for off, idx in pieces:
            lo, hi, _ = idx[0].indices(rows)  # the piece's rows in the shard
            a, b = max(r, lo), min(r + nr, hi)
            if a >= b:
                continue
            where = (off[0] + a - lo, off[1] + c) if len(shape) == 2 else (off[0] + a - lo,)
            out.append((where, first + (a - r) * cols, (b - a, nc) if len(shape) == 2 else
                        (b - a,)))
    return out


@torch.no_grad()
def init_params(model, params: Iterable[nn.Parameter], seed: int) -> None:
    """GPT-2 initialisation of ``params``, some of ``model``'s (a GPT's held layers; e.g. the
    parameters of one ZeRO-3 unit, materialised from the meta device): each layer involved is
    drawn once on its canonical shapes (:func:`init_canonical`), so every parameter gets the
    value :meth:`distllm.models.GPT.reset_parameters` gives it."""
    where = {dst: (i, name, kind) for i in model.layer_ids
             for name, kind, dst in _layer_slots(model, i)}
    todo: dict[int, list] = {}
    for p in params:
        if p not in where:
            raise ValueError(f"init_params: a parameter of shape {tuple(p.shape)} is not one "
                             f"of the model's (layers {model.layer_ids})")
        i, name, kind = where[p]
        todo.setdefault(i, []).append((p, name, kind))
    for i, items in todo.items():
        full = init_canonical(model.cfg, i, seed, model.dtype)
        for p, name, kind in items:
            p.copy_(shard_full(model.cfg, model.dims, kind, full[name]))


def _layer_slots(model, i: int) -> list[tuple[str, str, nn.Parameter]]:
    """Layer ``i`` of ``model``: ``(canonical name, TP split, its parameter)`` of each."""
    layer = model.layers[str(i)]
    return [(name, kind, _get(layer, path))
            for name, (path, kind) in param_table(model.cfg, i, model.vocab_parallel).items()]


@torch.no_grad()
def load_layer(model, i: int, full: dict[str, torch.Tensor]) -> None:
    """Copy canonical tensors ``full`` into layer ``i`` of ``model`` (this rank's TP shard)."""
    cfg, dims = model.cfg, model.dims
    for name, kind, dst in _layer_slots(model, i):
        if name not in full:
            raise KeyError(f"layer {i}: canonical tensor {name!r} is missing")
        src = shard_full(cfg, dims, kind, full[name])
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"layer {i} {name}: shard shape {tuple(src.shape)} does not fit "
                             f"the module's {tuple(dst.shape)}")
        dst.copy_(src)


def _all_gather(t: torch.Tensor, dims: ParallelDims, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dims.tp)]
    dist.all_gather(parts, t.contiguous(), group=dims.tp_group)
    return torch.cat(parts, dim)


@torch.no_grad()
def unshard(cfg, dims: ParallelDims, kind: str, local: torch.Tensor) -> torch.Tensor:
    """Inverse of the TP split of one tensor (all-gather over TP when split)."""
    if kind == "rep":
        return local.detach().clone()
    if kind == "vocab":
        return _all_gather(local, dims, 0)[: cfg.vocab_size]
    if dims.tp == 1:
        return local.detach().clone()
    if kind == "col":
        return _all_gather(local, dims, 0)
    if kind == "row":
        return _all_gather(local, dims, 1)
    if kind == "qkv":
        gathered = _all_gather(local, dims, 0)
        rows = torch.cat([_qkv_rows(cfg, dims.tp, r) for r in range(dims.tp)])
        full = torch.empty((int(rows.max()) + 1, *local.shape[1:]), dtype=local.dtype,
                           device=local.device)
        full[rows.to(local.device)] = gathered  # (tp divides the KV heads: check_heads)
        return full
    raise AssertionError(kind)


def gather_layer(model, i: int, tensors: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Canonical full tensors of layer ``i`` (collective over TP). ``tensors`` maps a module
    path to a local tensor of the same shape to gather instead (e.g. an optimizer state)."""
    layer = model.layers[str(i)]
    out = {}
    for name, (path, kind) in param_table(model.cfg, i, model.vocab_parallel).items():
        local = _get(layer, path) if tensors is None else tensors[path]
        out[name] = unshard(model.cfg, model.dims, kind, local)
    return out


def module_paths(cfg, i: int) -> dict[str, str]:
    """canonical name -> parameter path inside layer ``i``."""
    return {name: path for name, (path, _) in param_table(cfg, i).items()}
