"""``ParallelDims``: the ``(pp, dp, tp)`` mesh of process groups, TP varying fastest.

Global rank ``r`` has coordinates ``pp_rank = r // (dp*tp)``, ``dp_rank = (r // tp) % dp``,
``tp_rank = r % tp``; so a TP group is ``tp`` consecutive ranks (one node's NVLink domain),
DP groups stride by ``tp``, and PP groups stride by ``dp*tp`` (across nodes).

One object holds every group and is passed explicitly to every module that communicates;
nothing is kept in globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["ParallelDims", "mesh_groups", "divisors"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_groups(world: int, tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Rank lists of every group of the ``(pp, dp, tp)`` mesh (pure arithmetic, no processes).

    Keys: ``tp``, ``dp``, ``pp``, ``dp_tp`` (a pipeline stage's ranks), ``pp_tp`` (the
    model-parallel ranks of one data-parallel replica).
    """
    assert tp * pp * dp == world
    coords = {r: (r // (dp * tp), (r // tp) % dp, r % tp) for r in range(world)}

    def by(fixed: tuple[int, ...]) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for r in range(world):
            key = tuple(coords[r][i] for i in fixed)
            groups.setdefault(key, []).append(r)
        return [groups[k] for k in sorted(groups)]

    return {
        "tp": by((0, 1)),  # same pp, dp: vary tp
        "dp": by((0, 2)),
        "pp": by((1, 2)),
        "dp_tp": by((0,)),
        "pp_tp": by((1,)),
    }


def _resolve(world: int, tp: int, pp: int, dp: int) -> int:
    for name, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: it must be a positive integer")
    if not isinstance(dp, int) or (dp < 1 and dp != -1):
        raise ValueError(
            f"dp={dp!r}: it must be a positive integer, or -1 to use every remaining rank"
        )
    if dp == -1:
        if world % (tp * pp) != 0:
            ok = [(t, p) for t in divisors(world) for p in divisors(world // t)]
            raise ValueError(
                f"dp=-1 cannot be inferred: world size {world} is not divisible by "
                f"tp*pp={tp * pp}; "
                f"choose (tp, pp) with tp*pp dividing {world}, e.g. {ok[:8]}"
            )
        dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise ValueError(
            f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not match the world size {world}: "
            f"set dp=-1 to infer it, or choose sizes whose product is {world} "
            f"(tp and pp from {divisors(world)})"
        )
    return dp


def _init_from_env(backend: str | None, timeout: datetime.timedelta) -> None:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # a single process that never went through torchrun
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


@dataclass
class ParallelDims:
    """The process groups of a ``(pp, dp, tp)`` mesh over the current ``torch.distributed`` world.

    Args:
        tp: tensor-parallel size (consecutive ranks).
        pp: pipeline-parallel size (outermost).
        dp: data-parallel size; ``-1`` takes every remaining rank (``world // (tp*pp)``).
        backend: used only when this object has to start ``torch.distributed`` itself
            (from torchrun's environment, or a 1-rank world): ``nccl`` with CUDA, else ``gloo``.
        timeout_s: collective timeout, so that a dead rank ends the job instead of hanging it.
    """

    tp: int = 1
    pp: int = 1
    dp: int = -1
    backend: str | None = None
    timeout_s: float = 600.0
    rank: int = field(init=False)
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            _resolve(int(os.environ.get("WORLD_SIZE", "1")), self.tp, self.pp, self.dp)
            _init_from_env(self.backend, datetime.timedelta(seconds=self.timeout_s))
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp = _resolve(self.world_size, self.tp, self.pp, self.dp)
        self.groups = mesh_groups(self.world_size, self.tp, self.pp, self.dp)
        self._pg: dict[str, ProcessGroup] = {}
        for name, rank_lists in self.groups.items():
            # every rank takes part in creating every group, in the same order
            mine, _ = dist.new_subgroups_by_enumeration(rank_lists)
            self._pg[name] = mine

    # --- coordinates -------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)``."""
        return (self.pp_rank, self.dp_rank, self.tp_rank)

    # --- groups ------------------------------------------------------------------------
    @property
    def tp_group(self) -> ProcessGroup:
        return self._pg["tp"]

    @property
    def dp_group(self) -> ProcessGroup:
        return self._pg["dp"]

    @property
    def pp_group(self) -> ProcessGroup:
        return self._pg["pp"]

    @property
    def stage_group(self) -> ProcessGroup:
        """All ranks of this pipeline stage (dp x tp)."""
        return self._pg["dp_tp"]

    @property
    def model_parallel_group(self) -> ProcessGroup:
        """All ranks holding one replica of the model (pp x tp)."""
        return self._pg["pp_tp"]

    @property
    def world_group(self) -> ProcessGroup:
        return dist.group.WORLD

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group ``name`` (tp, dp, pp, dp_tp, pp_tp)."""
        return next(g for g in self.groups[name] if self.rank in g)

    # --- pipeline neighbours -----------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def next_pp_rank(self) -> int | None:
        """Global rank of the next stage (same dp, tp), or None on the last stage."""
        return None if self.is_last_stage else self.rank + self.dp * self.tp

    @property
    def prev_pp_rank(self) -> int | None:
        return None if self.is_first_stage else self.rank - self.dp * self.tp

    @property
    def device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return (
            f"ParallelDims(tp={self.tp}, pp={self.pp}, dp={self.dp}, rank={self.rank}, "
            f"coords(pp,dp,tp)={self.coords})"
        )
