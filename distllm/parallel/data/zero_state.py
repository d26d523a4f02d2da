"""ZeRO checkpoints: shards gathered into full tensors per parameter name, and back; or each
rank's own shard as ranges of the parameters' elements, with no collective
(:func:`shard_pieces`, :func:`shard_targets`: what ``distllm train``'s checkpoints write and
read).

``gather_state(z)`` returns::

    {"stage": int, "skipped_steps": int, "loss_scale": float,
     "loss_scaler": {"dynamic": bool, "scale": float, "good_steps": int},
     "param_groups": [hyper-parameters of each group, without "params"],
     "master": {name: full fp32 (master dtype) tensor shaped like the parameter},
     "state":  {name: {key: full tensor shaped like the parameter, or the scalar as is}},
     "elementwise_keys": [the state keys of the first kind]}

identical on every DP rank (collective: one all-gather over DP per bucket and state key),
so a ``torch.distributed.checkpoint`` save writes each tensor once, and the DP size may
change between save and load. ``load_state`` slices this rank's shard out of it, and
restores the loss scaler's state only into a dynamic scaler (see
:meth:`~distllm.parallel.data.loss_scale.LossScaler.load_state_dict`; a checkpoint without
``"loss_scaler"`` gives its ``"loss_scale"``).

:class:`ModuleStateHooks` keeps the model's own ``state_dict()`` / ``load_state_dict()``
meaningful under ZeRO: at stage 3 the units involved are gathered around them (a collective
over DP), a saved parameter is a full copy (never a view of a buffer freed right after),
and loaded values go into this rank's shard; at every stage, loaded values also reach the
fp32 master weights under mixed precision (else the next step would overwrite them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from distllm.comm.collectives import all_gather
from distllm.parallel.data.hooks import remove_hooks, removed_with, weak_hook

__all__ = ["gather_state", "load_state", "is_elementwise", "place_step", "shard_pieces",
           "shard_targets", "ModuleStateHooks"]


def _full(z, shard: Tensor) -> Tensor:
    """The whole bucket from this rank's ``shard`` of it (all-gather over DP for stage >= 1)."""
    if z.stage == 0 or z.nranks == 1:
        return shard.detach().clone()
    out = torch.empty(shard.numel() * z.nranks, dtype=shard.dtype, device=shard.device)
    all_gather(out, shard.detach().contiguous(), group=z.group)
    return out


def _split(z, i: int, full: Tensor, device: torch.device | str | None = None
           ) -> dict[str, Tensor]:
    """Bucket ``i``'s parameters' tensors cut from ``full``, copied (to ``device`` if given)."""
    b = z.reducer.buckets[i]
    return {z.names[p]: full[off: off + shape.numel()].view(shape).to(device, copy=True)
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True)}


def is_elementwise(v: Any, m: Tensor) -> bool:
    """Whether optimizer state ``v`` of tensor ``m`` holds one value per element of ``m``."""
    return isinstance(v, Tensor) and v.shape == m.shape and v.dim() > 0


@torch.no_grad()
def place_step(optimizer: torch.optim.Optimizer, param: Tensor, step: Any) -> Tensor:
    """The optimizer step count as ``optimizer`` keeps it for ``param``: on the parameter's
    device in fp32 when its group is ``fused`` or ``capturable`` (the fused AdamW kernel
    refuses a CPU step beside CUDA parameters), else on the CPU as given. The rule of
    ``torch.optim.Optimizer.load_state_dict``, for state set without it."""
    # a step count is optimizer state, never a collective's operand (gather_state copies it
    # as is): made on the CPU, then placed by torch's rule below
    value = step if isinstance(step, Tensor) else torch.tensor(float(step))
    for g in optimizer.param_groups:
        if any(q is param for q in g["params"]):
            if g.get("fused") or g.get("capturable"):
                # a copy: one step tensor shared by several parameters would be advanced
                # once per parameter at each step (the fused kernel adds in place)
                return value.to(dtype=torch.float32, device=param.device, copy=True)
            break
    return value.clone()


def shard_state(z, i: int) -> dict[str, Any]:
    """The inner optimizer's state of ``z``'s master ``i`` as if its whole shard were one
    tensor: each elementwise entry of its segments laid out in a tensor shaped like the
    master, any other entry (a step count, the same for every segment) as the first segment
    holds it. Empty before the first step."""
    m = z.masters[i]
    out: dict[str, Any] = {}
    for s in z.bucket_segments[i]:
        for key, v in z.optimizer.state.get(s.tensor, {}).items():
            if s.tensor is m or not is_elementwise(v, s.tensor):
                out.setdefault(key, v)
                continue
            if key not in out:
                out[key] = torch.zeros(m.shape, dtype=v.dtype, device=v.device)
            out[key][s.lo:s.hi].copy_(v)
    return out


def load_shard_state(z, i: int, state: dict[str, Any]) -> None:
    """Replace the inner optimizer's state of ``z``'s master ``i`` with ``state`` laid out as
    :func:`shard_state` gives it (entries shaped like the master are split between its
    segments, copied; others are copied to each; an empty ``state``: none, as before
    the first step)."""
    m = z.masters[i]
    for s in z.bucket_segments[i]:
        st = z.optimizer.state[s.tensor]
        st.clear()
        for key, v in state.items():
            if is_elementwise(v, m):
                st[key] = v[s.lo:s.hi].clone()
            elif key == "step":
                st[key] = place_step(z.optimizer, s.tensor, v)
            else:
                st[key] = v.clone() if isinstance(v, Tensor) else v


def gather_state(z, device: torch.device | str | None = None) -> dict[str, Any]:
    """:meth:`ZeroOptimizer.state_dict`: every tensor on ``device`` (None: the masters'), a
    bucket at a time, so that only one bucket's gathered tensor is on the masters' device at
    once (``"cpu"``: a checkpoint of a model whose full state would not fit the GPU)."""
    master: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    elementwise: set[str] = set()
    for i, m in enumerate(z.masters):
        master.update(_split(z, i, _full(z, m), device))
        st = shard_state(z, i)
        names = [z.names[p] for p in z.reducer.buckets[i].params]
        for n in names:
            state[n] = {}
        for key in sorted(st):
            v = st[key]
            if is_elementwise(v, m):
                elementwise.add(key)
                for n, t in _split(z, i, _full(z, v), device).items():
                    state[n][key] = t
            else:
                for n in names:  # a step count (a fused AdamW's is on the GPU)
                    state[n][key] = v.to(device, copy=True) if isinstance(v, Tensor) else v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in z.optimizer.param_groups]
    return {"stage": z.stage, "skipped_steps": z.skipped_steps, "loss_scale": z.loss_scale,
            "loss_scaler": z.scaler.state_dict(), "param_groups": groups, "master": master,
            "state": state, "elementwise_keys": sorted(elementwise)}


def _is_elementwise_key(sd: dict[str, Any], key: str, per: dict[str, Any],
                        shapes: list[torch.Size]) -> bool:
    """Whether state ``key`` holds a value per element (``per``: each parameter's saved
    value, ``shapes``: the parameters'): as :func:`gather_state` recorded it (a scalar
    parameter's moments are 0-dim, like a step count); in a dict without that record (one
    saved before any step, a template filled in by hand, or
    one from before the record), every value shaped like its parameter, the step count
    excepted."""
    if sd.get("elementwise_keys"):
        return key in sd["elementwise_keys"]
    return key != "step" and all(isinstance(v, Tensor) and v.shape == s
                                 for v, s in zip(per.values(), shapes, strict=True))


def _my_slice(z, i: int, per_param: dict[str, Tensor], like: Tensor) -> Tensor:
    """This rank's shard of bucket ``i`` assembled from full per-parameter tensors, in
    ``like``'s dtype on the device of bucket ``i``'s master (the tensors may be elsewhere:
    a template from ``state_dict(device="cpu")``)."""
    b = z.reducer.buckets[i]
    full = torch.zeros(b.numel, dtype=like.dtype, device=z.masters[i].device)
    for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
        full[off: off + shape.numel()].copy_(per_param[z.names[p]].reshape(-1))
    lo, hi = z.shard_range(b.numel)
    return full[lo:hi]


@torch.no_grad()
def load_state(z, sd: dict[str, Any]) -> None:
    missing = [z.names[p] for p in z.reducer.params() if z.names[p] not in sd["master"]]
    if missing:
        raise KeyError(f"state dict lacks master weights for {missing[:5]} (a different model?)")
    for i, m in enumerate(z.masters):
        m.copy_(_my_slice(z, i, sd["master"], m))
        b = z.reducer.buckets[i]
        names = [z.names[p] for p in b.params]
        st: dict[str, Any] = {}
        for key, v in sd["state"].get(names[0], {}).items():
            per = {n: sd["state"][n][key] for n in names}
            each = _is_elementwise_key(sd, key, per, list(b.shapes))
            st[key] = _my_slice(z, i, per, v) if each else v
        load_shard_state(z, i, st)  # replaces the state (none: as before the first step)
    for g, saved in zip(z.optimizer.param_groups, sd["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
    z.skipped_steps = int(sd.get("skipped_steps", 0))
    z.scaler.load_state_dict(sd.get("loss_scaler", {"scale": sd.get("loss_scale")}))
    z.publish_params()


def _ranges(z, i: int):
    """``(name, shape, start, stop, lo)`` of each parameter of bucket ``i`` that this rank's
    shard holds part of: its full shape (a ZeRO-3 parameter is empty between its uses), its
    flattened elements ``[start, stop)``, at ``lo`` in the shard."""
    b = z.reducer.buckets[i]
    first, last = z.shard_range(b.numel)
    for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
        a, e = max(off, first), min(off + shape.numel(), last)
        if a < e:
            yield z.names[p], tuple(shape), a - off, e - off, a - first


def shard_pieces(z) -> tuple[dict[str, tuple[tuple[int, ...], list]], int]:
    """This rank's own part of each parameter's master weight and elementwise optimizer
    state, with no collective and no copy: ``({name: (shape, [(start, stop, {"weight": t,
    key: t, ...})])}, step)``, each ``t`` a flat view of the master shard, or of the inner
    optimizer's state of one segment, for the flattened elements ``[start, stop)`` of the
    parameter (its full ``shape``; a parameter outside the shard: no entry); and the
    optimizer step (0 before the first). A segment without a state key the others have
    (never stepped) gives zeros."""
    out: dict[str, tuple[tuple[int, ...], list]] = {}
    step = 0
    segs = []  # per bucket: [(lo, hi, {key: the values of shard elements [lo, hi)})]
    keys: set[str] = set()
    for i, m in enumerate(z.masters):
        segs.append([])
        for s in z.bucket_segments[i]:
            st = z.optimizer.state.get(s.tensor, {})
            if "step" in st:
                step = max(step, int(st["step"]))
            each = {k: v for k, v in st.items() if is_elementwise(v, s.tensor)}
            keys |= each.keys()
            segs[-1].append((s.lo, s.hi, {"weight": m[s.lo:s.hi], **each}))
    for i, m in enumerate(z.masters):
        for lo, hi, each in segs[i]:
            for k in keys - each.keys():
                each[k] = torch.zeros(hi - lo, dtype=m.dtype)
        for name, shape, a, e, lo in _ranges(z, i):
            for slo, shi, each in segs[i]:  # the parameter's range, cut where segments meet
                x, y = max(lo, slo), min(lo + e - a, shi)
                if x < y:
                    out.setdefault(name, (shape, []))[1].append(
                        (a + x - lo, a + y - lo,
                         {k: v.detach()[x - slo: y - slo] for k, v in each.items()}))
    return out, step


def shard_targets(z, keys: tuple[str, ...]):
    """Tensors to read this rank's shard into, as :func:`shard_pieces` lays them out (zeros,
    in the masters' dtype, on the CPU), and ``commit(step)``, which loads them: the master
    weights, the optimizer state of ``keys`` other than ``"weight"`` with the step count
    (none when only the weights are given: as before the first step), then the compute
    parameters (collective over DP, as :meth:`ZeroOptimizer.load_state_dict`)."""
    flat = [{k: torch.zeros(m.shape, dtype=m.dtype) for k in keys} for m in z.masters]
    out: dict[str, tuple[tuple[int, ...], list]] = {}
    for i, each in enumerate(flat):
        for name, shape, a, e, lo in _ranges(z, i):
            out.setdefault(name, (shape, []))[1].append(
                (a, e, {k: v[lo: lo + e - a] for k, v in each.items()}))

    @torch.no_grad()
    def commit(step: int) -> None:
        z.wait_params()
        for i, (m, each) in enumerate(zip(z.masters, flat, strict=True)):
            m.copy_(each["weight"])
            st = {k: v.to(m.device) for k, v in each.items() if k != "weight"}
            load_shard_state(z, i, {**st, "step": step} if st else {})
        z.publish_params()
        z.wait_params()

    return out, commit


class ModuleStateHooks:
    """``state_dict`` / ``load_state_dict`` hooks on the modules of ``z.module`` that hold
    parameters of ``z`` directly (and, at stage 3, on its gather units). Each hook handles the
    parameters its own module holds, so calling either method on a submodule works too."""

    def __init__(self, z) -> None:
        self.z, self.sharded = z, z.sharded
        self.where = {p: (i, off) for i, b in enumerate(z.reducer.buckets)
                      for p, off in zip(b.params, b.offsets, strict=True)}
        self._gathered: dict[nn.Module, list] = {}
        self._incoming: dict[nn.Module, dict[nn.Parameter, Tensor]] = {}
        self.handles = removed_with(self, [])  # weak hooks: they must not keep z alive
        for mod in z.module.modules():
            own = any(p in self.where for p in mod.parameters(recurse=False))
            if not (own or (self.sharded is not None and mod in self.sharded.flats)):
                continue
            # weak: the model's hooks must not keep the optimizer alive (see hooks.py); plain
            # functions (torch marks the state-dict post-hook with an attribute)
            cls = ModuleStateHooks
            self.handles += [
                mod.register_state_dict_pre_hook(weak_hook(self, cls._save_pre)),
                mod.register_state_dict_post_hook(weak_hook(self, cls._save_post)),
                mod.register_load_state_dict_pre_hook(weak_hook(self, cls._load_pre)),
                mod.register_load_state_dict_post_hook(weak_hook(self, cls._load_post))]

    def remove_hooks(self) -> None:
        """Remove the state-dict hooks (a newer wrapper owns the parameters)."""
        remove_hooks(self.handles)

    def _gather(self, mod: nn.Module) -> None:
        self.z.wait_params()
        if self.sharded is not None:
            self._gathered[mod] = self.sharded.gather(self.sharded.units_covering(mod))

    def _own(self, mod: nn.Module):
        return ((n, p) for n, p in mod.named_parameters(recurse=False, remove_duplicate=False)
                if p in self.where)

    def _save_pre(self, mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._gather(mod)

    @torch.no_grad()
    def _save_post(self, mod: nn.Module, sd: dict, prefix: str, _meta) -> None:
        if self.sharded is None:
            return
        for n, p in self._own(mod):  # copies: the gathered storage is freed just below
            v = sd.get(prefix + n)
            if isinstance(v, Tensor) and p.numel() and (
                    v.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()):
                sd[prefix + n] = v.detach().clone()
        self.sharded.release(self._gathered.pop(mod, []))

    def _load_pre(self, mod: nn.Module, sd: dict, prefix: str, meta: dict, *_rest) -> None:
        if meta.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) would replace parameters that "
                             "ZeroOptimizer has packed into its buffers: use assign=False")
        self._gather(mod)  # stage 3: the parameters take their full shape to be loaded into
        self._incoming[mod] = {p: sd[prefix + n] for n, p in self._own(mod)
                               if isinstance(sd.get(prefix + n), Tensor)
                               and sd[prefix + n].shape == p.shape}

    @torch.no_grad()
    def _load_post(self, mod: nn.Module, _incompatible) -> None:
        incoming = self._incoming.pop(mod, {})
        if self.z.mixed:  # else the masters are the parameters' storage (or shard) itself
            for p, v in incoming.items():
                self._set_master(p, v)
        if self.sharded is not None:
            # every gathered unit the load wrote into, also one a forward keeps gathered for
            # backward (not gathered here: its values went nowhere at the next reshard)
            self.sharded.commit(self.sharded.units_covering(mod))
            self.sharded.release(self._gathered.pop(mod, []))

    def _set_master(self, p: nn.Parameter, v: Tensor) -> None:
        """Write full value ``v`` of ``p`` into the part of its master shard this rank has."""
        i, off = self.where[p]
        lo, hi = self.z.shard_range(self.z.reducer.buckets[i].numel)
        a, e = max(off, lo), min(off + v.numel(), hi)
        if a < e:
            self.z.masters[i][a - lo: e - lo].copy_(v.reshape(-1)[a - off: e - off])
