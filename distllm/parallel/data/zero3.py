"""ZeRO-3 parameter sharding: each layer's parameters are gathered just before use.

Each *unit* (a layer; by default every child of the outermost ``ModuleList``/``Sequential``
containers; leftover parameters, and those a module outside the unit also holds such as a
weight tied between two layers, form the root unit) packs its parameters into one flat
buffer per optimizer param group, padded to a multiple of the DP size ``N``. A rank keeps
only its slice (``L/N`` elements) between uses; the full buffer's storage is freed
(``untyped_storage().resize_(0)``) and re-allocated for each gather, so views of it saved
for backward remain valid. The parameters stay the same ``nn.Parameter`` objects: while
gathered, ``p.data`` is its view of the full buffer; while sharded it is an empty tensor
(so reading a sharded parameter outside its layer's forward/backward fails loudly).
Construction goes a unit at a time, each one's full buffer freed before the next is packed,
so a rank never holds more than one unit whole beside what it was given. A model built on
the meta device is materialised that way too (``param_init_fn``, FSDP's deferred
initialisation): a unit's parameters are replaced once, by new ones on the device that the
function fills, just before the unit is packed.
``module.state_dict()`` and ``module.load_state_dict()`` still see full tensors: hooks
installed by :class:`~distllm.parallel.ZeroOptimizer` gather the units involved around
them (:meth:`ShardedParams.gather` / :meth:`ShardedParams.release`).

Forward: a forward pre-hook all-gathers the unit (waiting on its prefetch, if any) and
starts the all-gather of the next unit (``prefetch=True``); a forward post-hook frees it
(except the root, needed first in backward) and hooks the unit's outputs.
Backward: the first gradient reaching a unit's outputs all-gathers it again and prefetches
the unit that runs backward next; when every parameter of the unit has its gradient
accumulated in this backward pass, the full parameters are freed (the gradient bucket is
reduce-scattered by :class:`~distllm.parallel.data.buckets.GradBuckets`). The count restarts
with each backward pass (micro-batch).

A parameter may get no gradient in a pass, on some DP ranks only (a gate or an expert that
one rank's data does not use). Every collective must still come in the same order on every
rank, so a unit is also closed by an event that every rank sees at the same point: the
gradient of its tensor inputs (:class:`_UnitBackward`, the way FSDP2 detects a module's
post-backward). There its parameters without a gradient count as zeros, its bucket may be
reduce-scattered, and it is freed. A unit whose inputs need no gradient (the embedding), and
the root, are freed at the end of each backward pass (an autograd callback); ``step`` and
loading a state first free every unit still gathered, whose values it is about to change.
A parameter must therefore get its gradient within its own unit's calls: one that code
outside the unit reads (not through a module outside it, which would give it to the root)
is counted as zero when the unit closes, and its late gradient is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from distllm.comm.collectives import all_gather
from distllm.parallel.data.buckets import GradBuckets
from distllm.parallel.data.hooks import remove_hooks, removed_with, weak_hook
from distllm.parallel.data.replicas import broadcast_from_dp0

__all__ = ["ShardedParams", "default_units", "unit_reads"]


def default_units(module: nn.Module) -> list[nn.Module]:
    """Children of the outermost ``ModuleList``/``Sequential`` containers that hold
    parameters, in registration order (the usual forward order of a layer stack)."""
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                units.extend(c for c in child.children() if any(True for _ in c.parameters()))
            else:
                walk(child)

    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return [c for c in module.children() if any(True for _ in c.parameters())]
    walk(module)
    return units


def borrowed(m: nn.Module) -> list[nn.Parameter]:
    """Parameters ``m``'s forward reads though another module holds them: a module that
    computes its neighbour's GEMM too (the head of a fused MLP, :func:`distllm.nn.fuse`)
    says so with a ``borrowed_parameters()`` method."""
    fn = getattr(m, "borrowed_parameters", None)
    return list(fn()) if fn is not None else []


def unit_reads(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters a unit's forward reads: its subtree's and those its modules borrow."""
    seen = dict.fromkeys(unit.parameters())
    for m in unit.modules():
        seen.update(dict.fromkeys(borrowed(m)))
    return list(seen)


def _owners(module: nn.Module, units: list[nn.Module]) -> dict[nn.Parameter, nn.Module]:
    """The unit of each parameter: the first unit whose subtree holds every module that holds
    or borrows it. A parameter also held outside that subtree (a weight tied between two
    layers, e.g. a head sharing the embedding's matrix) is left to the root unit, which stays
    gathered from the first forward of a step to the end of its backward: a unit's own
    parameters are freed after its forward, before the other holder reads them."""
    holders: dict[nn.Parameter, list[nn.Module]] = {}
    for m in module.modules():
        for p in [*m.parameters(recurse=False), *borrowed(m)]:
            holders.setdefault(p, []).append(m)
    owner: dict[nn.Parameter, nn.Module] = {}
    for u in units:
        inside = set(u.modules())
        for p in u.parameters():
            if p not in owner and all(h in inside for h in holders.get(p, ())):
                owner[p] = u
    return owner


class _UnitBackward(torch.autograd.Function):
    """Identity on one call's tensor inputs of a unit; its backward runs once the gradients
    of those inputs are complete, i.e. once that call's backward is done (a parameter's
    accumulation runs before any other node that became ready with it)."""

    @staticmethod
    def forward(ctx, sharded: ShardedParams, unit: nn.Module, *xs: Tensor):
        ctx.sharded, ctx.unit = sharded, unit
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharded._post_backward(ctx.unit)
        return (None, None, *grads)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class _Flat:
    params: list[nn.Parameter]
    views: list[Tensor]  # each param's view of ``full`` (what ``p.data`` is while gathered)
    numel: int  # padded to a multiple of N
    full: Tensor  # compute dtype; storage freed while sharded
    shard: Tensor  # compute dtype, this rank's slice
    # this rank's slice in the parameters' widest dtype (initial masters), where it is not the
    # compute dtype (else the shard holds the same values)
    master_src: Tensor | None
    work: object = None
    state: str = "full"  # "sharded" | "gathering" | "full"


class ShardedParams:
    """The stage-3 parameter shards of one module and the hooks that gather them."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], gid: dict, *,
                 units: list[nn.Module] | None, dims, group, param_dtype: torch.dtype,
                 prefetch: bool, param_init_fn: Callable | None = None) -> None:
        self.module, self.group, self.prefetch = module, group, prefetch
        self.dims = dims
        self.nranks = dims.dp if group is not None else 1
        self.rank = dims.dp_rank if group is not None else 0
        self.param_dtype = param_dtype
        # where the shards live: the parameters' device, or the mesh's for a model built on
        # the meta device
        real = [p for p in params if not p.is_meta]
        self.device = real[0].device if real else dims.device
        self._empty = torch.empty(0, dtype=param_dtype, device=self.device)
        units = list(units) if units is not None else default_units(module)
        if module in units:
            units.remove(module)
        owner = _owners(module, units)
        for p in params:
            owner.setdefault(p, module)  # leftovers and shared parameters: the root unit
        self.units = units + [module]  # forward order of the non-root units, then the root
        self.flats: dict[nn.Module, list[_Flat]] = {}
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}  # (meta-device ones: _materialize)
        # one flat per unit, each param group's parameters together; a unit at a time: its
        # parameters materialised (if on the meta device), packed, and the full buffer freed
        # at once, so that no more than one unit is ever whole here (the model's own tensors
        # aside, where it was built on a real device)
        try:
            for u in self.units:
                mine = sorted((p for p in params if owner[p] is u), key=gid.__getitem__)
                self.flats[u] = []
                if mine:
                    mine = self._materialize(u, mine, param_init_fn)
                    self.flats[u].append(self._make_flat(mine))
                    self._free(self.flats[u][0])  # (a later unit's init reads it as empty)
        except BaseException:
            self.empty_params()  # (an init that failed: no view of freed memory is left)
            raise
        self.unit_of = {p: u for u in self.units for f in self.flats[u] for p in f.params}
        self._landed: dict[nn.Module, set] = {u: set() for u in self.units}
        self._landed_pass: dict[nn.Module, int | None] = {u: None for u in self.units}
        # units recomputed inside a backward whose own backward has not started yet (under
        # reentrant checkpointing, that backward is a pass nested in the outer one)
        self._recomputed: set[nn.Module] = set()
        self.reducer: GradBuckets | None = None
        # calls of each unit whose backward is still to run (:class:`_UnitBackward`)
        self._pending: dict[nn.Module, int] = dict.fromkeys(self.units, 0)
        self._end_queued_for: int | None = None  # the backward pass whose end reshards all
        self._order: list[nn.Module] = [u for u in self.units if u is not module]
        self._seen: list[nn.Module] = []
        self._hooks = removed_with(self, [])  # weak hooks: they must not keep this alive
        pre, post = weak_hook(self, ShardedParams._pre_forward), weak_hook(
            self, ShardedParams._post_forward)
        for u in self.units:
            if not self.flats[u]:
                continue
            self._hooks.append(u.register_forward_pre_hook(pre))
            self._hooks.append(u.register_forward_hook(post))
        if not self.flats[module]:  # still record the start of each forward
            self._hooks.append(module.register_forward_pre_hook(pre))

    def remove_hooks(self) -> None:
        """Remove the model's forward and gradient hooks (a newer wrapper owns it)."""
        remove_hooks(self._hooks)

    # --- layout --------------------------------------------------------------------------
    @torch.no_grad()
    def _materialize(self, u: nn.Module, ps: list[nn.Parameter],
                     param_init_fn: Callable | None) -> list[nn.Parameter]:
        """``ps`` with each parameter on the meta device replaced by a new one on
        :attr:`device` (zeros; its attributes, such as the tensor-parallel split, kept), in
        every module slot that held it (a tied weight stays tied; as ``Module.to_empty``, a
        new object: :attr:`replaced` maps old to new). ``param_init_fn(u, new ones)`` then
        fills them and DP rank 0's values are broadcast, as the model's real parameters were
        before sharding (:func:`broadcast_from_dp0`)."""
        new: dict[nn.Parameter, nn.Parameter] = {}
        for p in ps:
            if p.is_meta:
                q = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=self.device),
                                 requires_grad=p.requires_grad)
                for k, v in vars(p).items():
                    vars(q).setdefault(k, v)
                new[p] = q
        if not new:
            return ps
        for m in self.module.modules():
            for k, v in m._parameters.items():
                if v is not None and v in new:
                    m._parameters[k] = new[v]
        self.replaced.update(new)
        made = list(new.values())
        param_init_fn(u, made)
        if self.group is not None:
            broadcast_from_dp0(made, self.dims)
        return [new.get(p, p) for p in ps]

    @torch.no_grad()
    def _make_flat(self, ps: list[nn.Parameter]) -> _Flat:
        n = sum(p.numel() for p in ps)
        numel = n + (-n % self.nranks)
        # the widest of the unit's dtypes: an fp32 parameter beside bf16 ones keeps its
        # initial value exactly in the fp32 masters (read from this buffer)
        wide = functools.reduce(torch.promote_types, (p.dtype for p in ps))
        src = torch.zeros(numel, dtype=wide, device=self.device)
        off = 0
        for p in ps:
            src[off: off + p.numel()].copy_(p.detach().reshape(-1))
            off += p.numel()
        s = numel // self.nranks
        lo = self.rank * s
        same = src.dtype == self.param_dtype
        master_src = None if same else src[lo: lo + s].clone()
        full = src if same else src.to(self.param_dtype)  # (no copy when it can be the buffer)
        views, off = [], 0
        for p in ps:
            views.append(full[off: off + p.numel()].view_as(p))
            p.data = views[-1]
            off += p.numel()
        return _Flat(list(ps), views, numel, full, full[lo: lo + s].clone(), master_src)

    def bucket_params(self) -> list[list[nn.Parameter]]:
        """Gradient buckets, first reduced first: the units in reverse forward order, root
        (whose embedding gradient lands last) at the end."""
        order = [u for u in reversed(self.units[:-1])] + [self.module]
        self._bucket_flats = [f for u in order for f in self.flats[u]]
        return [f.params for f in self._bucket_flats]

    def shard_of(self, i: int) -> Tensor:
        return self._bucket_flats[i].shard

    def master_init(self, i: int) -> Tensor:
        """The initial master values of bucket ``i``'s shard (handed over once, then dropped)."""
        f = self._bucket_flats[i]
        src, f.master_src = (f.master_src if f.master_src is not None else f.shard), None
        return src

    def attach(self, reducer: GradBuckets) -> None:
        """Free a unit's gathered parameters once all their gradients have landed (this hook
        runs after the reducer's, which has already copied the gradient into its bucket)."""
        self.reducer = reducer
        landed = weak_hook(self, ShardedParams._grad_landed)
        for p in reducer.params():
            self._hooks.append(p.register_post_accumulate_grad_hook(landed))
        # from now on parameters live as shards between uses: a sharded parameter reads as
        # empty (until here, the reducer's buckets read their shapes)
        self.reshard_all()
        self.empty_params()

    def empty_params(self) -> None:
        """Every packed unit's parameters read as empty, not as their views of the freed
        buffers, whose reads would touch freed memory (after :meth:`shapes_for_buckets`)."""
        for fl in self.flats.values():
            for f in fl:
                self._free(f)

    def shapes_for_buckets(self) -> None:
        """Every parameter as its view of its (freed) buffer, for the gradient buckets to read
        their shapes; :meth:`attach` (or :meth:`empty_params`, if they fail) ends it."""
        for fl in self.flats.values():
            for f in fl:
                for p, v in zip(f.params, f.views, strict=True):
                    p.data = v

    # --- gather / free -------------------------------------------------------------------
    @torch.no_grad()
    def unshard(self, u: nn.Module, wait: bool) -> None:
        for f in self.flats[u]:
            if f.state == "sharded":
                f.full.untyped_storage().resize_(f.numel * f.full.element_size())
                if self.group is None:
                    f.full.copy_(f.shard)
                else:
                    f.work = all_gather(f.full, f.shard, group=self.group, async_op=True)
                f.state = "gathering"
        if wait:
            for f in self.flats[u]:
                if f.state == "gathering":
                    if f.work is not None:
                        f.work.wait()
                        f.work = None
                    for p, v in zip(f.params, f.views, strict=True):
                        p.data = v
                    f.state = "full"

    def reshard(self, u: nn.Module) -> None:
        self.unshard(u, wait=True) if any(f.state == "gathering" for f in self.flats[u]) else None
        for f in self.flats[u]:
            if f.state == "full":
                self._free(f)

    def _free(self, f: _Flat) -> None:
        f.full.untyped_storage().resize_(0)
        for p in f.params:  # a sharded parameter reads as empty, never as freed memory
            p.data = self._empty
        f.state = "sharded"

    def reshard_all(self) -> None:
        for u in self.units:
            self.reshard(u)
            self._landed[u].clear()

    def end_step(self) -> None:
        """Free every unit (waiting for gathers in flight) and forget the forwards whose
        backward never ran: before the shards change (``step``, a load) and at the end of
        the synchronised backward."""
        self.reshard_all()
        self._pending = dict.fromkeys(self.units, 0)

    # --- reads and writes outside forward/backward (module state dicts) ---------------------
    def units_covering(self, mod: nn.Module) -> list[nn.Module]:
        """The units to gather before ``mod``'s own parameters can be read: ``mod`` itself if
        it is a unit, and the units of the parameters it holds directly (a tied weight may
        belong to another unit)."""
        out = [mod] if mod in self.flats else []
        for p in mod.parameters(recurse=False):
            u = self.unit_of.get(p)
            if u is not None and u not in out:
                out.append(u)
        return out

    @torch.no_grad()
    def gather(self, units: list[nn.Module]) -> list[_Flat]:
        """All-gather the sharded parameters of ``units`` (collective over DP; every DP rank
        calls it with the same units) and return the flats it gathered, for :meth:`release`."""
        todo = [f for u in units for f in self.flats[u] if f.state == "sharded"]
        for u in units:
            self.unshard(u, wait=False)
        for u in units:
            self.unshard(u, wait=True)
        return todo

    @torch.no_grad()
    def commit(self, units: list[nn.Module]) -> None:
        """Keep this rank's slice of what the gathered parameters of ``units`` now hold
        (values written while gathered), whoever gathered them (:meth:`gather`, or a forward
        that keeps its unit gathered for backward)."""
        for u in units:
            for f in self.flats[u]:
                if f.state == "full":
                    self._keep_slice(f)

    def _keep_slice(self, f: _Flat) -> None:
        """This rank's slice of gathered ``f``'s full values into its shard."""
        s = f.numel // self.nranks
        f.shard.copy_(f.full[self.rank * s: (self.rank + 1) * s])

    @torch.no_grad()
    def release(self, flats: list[_Flat]) -> None:
        """Free ``flats`` (gathered by :meth:`gather`) again (values written while gathered
        are kept by :meth:`commit` first)."""
        for f in flats:
            if f.state == "full":
                self._free(f)

    # --- hooks ---------------------------------------------------------------------------
    def _pre_forward(self, mod: nn.Module, args) -> tuple | None:
        if _in_backward():  # activation checkpointing recomputes the unit: its gather alone
            self._recomputed.add(mod)
            if mod is not self.module and self.flats[self.module]:
                self.unshard(self.module, wait=True)
            if self.flats.get(mod):
                self.unshard(mod, wait=True)
            return None  # (the forward order, and the backward's prefetch, stay as they are)
        if mod is self.module or mod in self._seen:  # a new forward (or micro-batch) begins
            if self._seen:
                self._order = [u for u in self._seen if u is not self.module]
            self._seen = []
            self._recomputed.clear()
        self._seen.append(mod)
        if mod is not self.module and self.flats[self.module]:
            self.unshard(self.module, wait=True)  # root leftovers, even if root is never called
        if self.flats.get(mod):
            self.unshard(mod, wait=True)
        if self.prefetch:
            nxt = self._next(mod, self._order)
            if nxt is not None:
                self.unshard(nxt, wait=False)
        if mod is not self.module and torch.is_grad_enabled():
            return self._track_backward(mod, args)
        return None

    def _track_backward(self, mod: nn.Module, args: tuple) -> tuple | None:
        """``args`` with its tensors that need a gradient passed through
        :class:`_UnitBackward` (the positional ones: a unit taking its activations only by
        keyword is freed at the end of the pass instead)."""
        idx = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not idx:
            return None
        self._pending[mod] += 1
        outs = _UnitBackward.apply(self, mod, *(args[i] for i in idx))
        new = list(args)
        for i, o in zip(idx, outs, strict=True):
            new[i] = o
        return tuple(new)

    @torch.no_grad()
    def _post_backward(self, u: nn.Module) -> None:
        """One call of unit ``u`` finished its backward. Once no call's backward is pending
        (a unit called twice in a forward: the first call's, which runs last; a pipeline with
        several micro-batches in flight: the last one's), its parameters without a gradient
        in this pass count as zeros (on this rank alone, perhaps: the others close the unit
        at this same point) and it is freed."""
        # (never below 0: a graph built before ``step`` forgot the pending calls may still
        # run backward)
        self._pending[u] = max(0, self._pending[u] - 1)
        if self._pending[u] > 0:
            return
        if self.reducer is not None:
            self.reducer.mark_unused(p for f in self.flats[u] for p in f.params)
        self._landed[u].clear()
        self.reshard(u)

    def _post_forward(self, mod: nn.Module, args, out) -> None:
        if torch.is_grad_enabled():
            ts = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
            if ts:
                torch.autograd.graph.register_multi_grad_hook(
                    ts, lambda _g, m=mod: self._pre_backward(m), mode="any")
        # a recomputation's unit stays gathered: its backward follows, and frees it as its
        # gradients land
        keep = torch.is_grad_enabled() and (
            mod is self.module or (self._order and mod is self._order[-1]) or _in_backward())
        if not keep:  # the root and the last layer stay gathered: backward starts with them
            self.reshard(mod)

    def _pre_backward(self, mod: nn.Module) -> None:
        # a unit's landed set counts the gradients of this backward pass only: a parameter
        # that got none in an earlier pass (unused in that micro-batch) must land again
        # before the unit is freed. Reset on the unit's first entry of the pass, not on each
        # (a unit called twice keeps what landed between its two backwards). A pass is an
        # autograd graph task (its id keys torch's own register_multi_grad_hook "any" mode).
        task = torch._C._current_graph_task_id()
        # the root is gathered with every unit; a recomputed unit's pass may be nested in the
        # outer one (reentrant checkpointing), whose root gradients have landed already
        nested = mod in self._recomputed
        self._recomputed.discard(mod)
        if not nested and self._end_queued_for != task:  # this pass's end frees every unit
            self._end_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
        for u in (mod,) if nested else (self.module, mod):
            if self._landed_pass[u] != task:
                self._landed_pass[u] = task
                self._landed[u].clear()
        if self.flats[self.module]:
            self.unshard(self.module, wait=True)
        self.unshard(mod, wait=True)
        if self.prefetch:
            bwd = [self.module] + list(reversed(self._order))
            nxt = self._next(mod, bwd)
            if nxt is not None:
                self.unshard(nxt, wait=False)

    def _end_of_pass(self) -> None:
        self._end_queued_for = None
        self.reshard_all()

    def _next(self, mod: nn.Module, order: list[nn.Module]) -> nn.Module | None:
        if mod in order:
            i = order.index(mod)
            return order[i + 1] if i + 1 < len(order) else None
        return order[0] if mod is self.module and order else None

    def _grad_landed(self, p: nn.Parameter) -> None:
        u = self.unit_of[p]
        self._landed[u].add(p)
        if len(self._landed[u]) == sum(len(f.params) for f in self.flats[u]):
            self._landed[u].clear()
            self.reshard(u)

    # --- inspection ---------------------------------------------------------------------
    def tensors(self) -> list[Tensor]:
        """Every shard, then every full buffer (a freed one holds no bytes)."""
        flats = [f for fl in self.flats.values() for f in fl]
        return [f.shard for f in flats] + [f.full for f in flats]

    def full_bytes_held(self) -> int:
        """Bytes of gathered (full) parameters held now: 0 when every unit is sharded."""
        return sum(f.full.untyped_storage().nbytes() for fl in self.flats.values() for f in fl)
