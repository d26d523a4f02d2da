"""ZeRO-1/2: the all-gather of the updated parameter shards after ``step``, overlapped with
the next forward.

Each bucket's all-gather is launched by ``step`` (the first layers' bucket as soon as the
optimizer has stepped it, before the other buckets; the others at the end) and waited for by
forward pre-hooks, so the gathers overlap the rest of the optimizer step and the next
forward: a *unit*
(a layer; by default the children of the outermost ``ModuleList``/``Sequential``
containers) waits for every bucket holding a parameter of its whole subtree, since a layer
may use its submodules' weights without calling them (a fused MLP reads both of its
linears' weights); a parameter outside every unit is waited for by the module that holds
it. Code reading a parameter outside these forwards waits for all of them first
(:meth:`ParamGathers.wait_all`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed import Work

from distllm.comm.collectives import all_gather
from distllm.parallel.data.bucket_layout import Bucket
from distllm.parallel.data.hooks import remove_hooks, removed_with, weak_hook

__all__ = ["ParamGathers"]


class ParamGathers:
    """The in-flight parameter all-gathers of one ZeRO optimizer, by bucket index.

    Args:
        module: the model whose modules get forward pre-hooks, or ``None`` (no hooks).
        buckets: the gradient buckets (their parameters are views of the flat buffers).
        units: the layers that wait for their whole subtree's buckets (default:
            :func:`distllm.parallel.data.zero3.default_units` of ``module``).
        group: the DP process group the shards are gathered over.
        overlap: install the forward pre-hooks; without them :attr:`overlapped` is False and
            the caller waits at once.
    """

    def __init__(self, module: nn.Module | None, buckets: list[Bucket], group,
                 overlap: bool, units: list[nn.Module] | None = None) -> None:
        self.group = group
        self.pending: dict[int, tuple[Work, Tensor]] = {}  # index -> (work, source kept alive)
        self.hooks = removed_with(self, [])  # weak hooks: they must not keep this alive
        if not overlap or module is None:
            return
        from distllm.parallel.data.zero3 import borrowed, default_units, unit_reads

        where = {p: b.index for b in buckets for p in b.params}
        units = [u for u in (units if units is not None else default_units(module))
                 if u is not module]
        covered: set[nn.Parameter] = set()
        for u in units:  # with what its modules borrow (a fused MLP's second linear)
            mine = [p for p in unit_reads(u) if p in where]
            covered.update(mine)
            self._hook(u, mine, where)
        for mod in module.modules():
            own = dict.fromkeys([*mod.parameters(recurse=False), *borrowed(mod)])
            self._hook(mod, [p for p in own if p not in covered], where)

    @property
    def overlapped(self) -> bool:
        """Whether forward pre-hooks wait for the gathers (else they must be waited at once)."""
        return bool(self.hooks)

    def launch(self, i: int, flat: Tensor, shard: Tensor) -> None:
        """Start gathering every rank's ``shard`` of bucket ``i`` into ``flat``."""
        self.pending[i] = (all_gather(flat, shard, group=self.group, async_op=True), shard)

    def wait(self, i: int) -> None:
        """Wait for bucket ``i``'s gather, if one is in flight."""
        pending = self.pending.pop(i, None)
        if pending is not None:
            pending[0].wait()

    def wait_all(self) -> None:
        """Wait for every gather in flight."""
        for i in list(self.pending):
            self.wait(i)

    def _hook(self, mod: nn.Module, params: list, where: dict) -> None:
        idx = sorted({where[p] for p in params if p in where})
        if idx:
            self.hooks.append(mod.register_forward_pre_hook(self._waiter(idx)))

    def _waiter(self, idx: list[int]) -> Callable[[nn.Module, object], None]:
        def wait(gathers: ParamGathers, _mod: nn.Module, _args: object) -> None:
            for i in idx:
                gathers.wait(i)

        return weak_hook(self, wait)  # the model's hooks must not keep this alive (hooks.py)

    def remove_hooks(self) -> None:
        """Remove the forward pre-hooks (a newer wrapper owns the parameters)."""
        remove_hooks(self.hooks)
