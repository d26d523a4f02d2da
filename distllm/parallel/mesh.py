"""``ParallelDims``: the ``(pp, dp, tp)`` mesh of process groups, TP varying fastest.

Global rank ``r`` has coordinates ``pp_rank = r // (dp*tp)``, ``dp_rank = (r // tp) % dp``,
``tp_rank = r % tp``; so a TP group is ``tp`` consecutive ranks (one node's NVLink domain),
DP groups stride by ``tp``, and PP groups stride by ``dp*tp`` (across nodes).

Two steps, so that the first is testable without processes:

1. validation: ``ParallelDims(tp, pp, dp, world_size=N)`` checks the integers against the
   world size, infers ``dp=-1`` and computes every group's rank list (pure arithmetic);
2. building: :meth:`ParallelDims.build` starts ``torch.distributed`` if needed and creates
   the process groups (a collective: every rank calls it).

``ParallelDims(tp, pp, dp)`` without ``world_size`` does both at once, over the current
world (started from torchrun's environment, or as a 1-rank world): what users write under
torchrun. One object holds every group and is passed explicitly to every module that
communicates; nothing is kept in globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distllm.comm.collectives import backend_for, group_device

__all__ = ["ParallelDims", "MeshShape", "mesh_groups", "divisors", "env_world_size"]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_groups(world: int, tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Rank lists of every group of the ``(pp, dp, tp)`` mesh (pure arithmetic, no processes).

    Keys: ``tp``, ``dp``, ``pp``, and ``pp_tp`` (the model-parallel ranks of one
    data-parallel replica, over which the gradient norm is reduced).
    """
    if tp * pp * dp != world:
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} does not match the world size {world}")
    coords = [(r // (dp * tp), (r // tp) % dp, r % tp) for r in range(world)]

    def by(fixed: tuple[int, ...]) -> list[list[int]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(world):
            groups.setdefault(tuple(coords[r][i] for i in fixed), []).append(r)
        return [groups[k] for k in sorted(groups)]

    return {
        "tp": by((0, 1)),  # same pp and dp coordinates: tp varies
        "dp": by((0, 2)),
        "pp": by((1, 2)),
        "pp_tp": by((1,)),
    }


def _resolve_dp(world: int, tp: int, pp: int, dp: int) -> int:
    """Validate the sizes against ``world`` and return ``dp`` (inferred when -1)."""
    for name, v in (("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}: it must be a positive integer")
    if not isinstance(dp, int) or isinstance(dp, bool) or (dp < 1 and dp != -1):
        raise ValueError(
            f"dp={dp!r}: it must be a positive integer, or -1 to use every remaining rank"
        )
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world_size={world!r}: it must be a positive integer")
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


def _current_world_size() -> int:
    """The running world's size, or the one torchrun announces (1 outside torchrun)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return env_world_size()


def env_world_size() -> int:
    """The world size a launcher announces: ``WORLD_SIZE`` where ``RANK`` is set too (the
    process group reads the environment only then, :func:`_init_from_env`), else 1. A stray
    ``WORLD_SIZE`` alone had planned a layout for that many ranks on a 1-rank world ("Rank 1
    is out of range")."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
"""The environment variables naming a rank's index on its machine: torchrun's, srun's,
mpirun's."""


def _local_device() -> int:
    """This rank's GPU: ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID`` or
    ``OMPI_COMM_WORLD_LOCAL_RANK`` (srun, mpirun), else the global rank; modulo the visible
    GPUs (srun's ``--gpus-per-task=1`` shows each task one GPU, its GPU 0, whatever its
    local id; and never GPU 0 for every rank: NCCL refuses two ranks on one GPU)."""
    rank = next((int(os.environ[v]) for v in LOCAL_RANK_VARS if v in os.environ),
                None)
    if rank is None:
        rank = int(os.environ["RANK"])
    return rank % max(1, torch.cuda.device_count())


def _uses_nccl(backend: str) -> bool:
    """Whether ``backend`` (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...) runs CUDA tensors'
    collectives on NCCL."""
    return backend == "nccl" or "cuda:nccl" in backend.replace(" ", "")


def _init_from_env(backend: str | None, timeout: datetime.timedelta) -> None:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if _uses_nccl(backend):
            torch.cuda.set_device(_local_device())
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # a single process that never went through torchrun
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


class MeshShape(Protocol):
    """Anything with mesh sizes: the training config's ``ParallelConfig``, the planner's
    ``Layout``, another ``ParallelDims``."""

    tp: int
    pp: int
    dp: int


@dataclass
class ParallelDims:
    """The ``(pp, dp, tp)`` mesh: sizes validated at construction, process groups built by
    :meth:`build` (at once when ``world_size`` is not given).

    Args:
        tp: tensor-parallel size (consecutive ranks).
        pp: pipeline-parallel size (outermost).
        dp: data-parallel size; ``-1`` takes every remaining rank (``world // (tp*pp)``).
        backend: used only when :meth:`build` has to start ``torch.distributed`` itself
            (from torchrun's environment, or a 1-rank world): ``nccl`` with CUDA, else ``gloo``.
        timeout_s: collective timeout, so that a dead rank ends the job instead of hanging it.
        world_size: ``None`` (default): the current world's, and the groups are built at
            once. An integer: the sizes are only validated against it (no processes, no
            groups) until :meth:`build` is called.
    """

    tp: int = 1
    pp: int = 1
    dp: int = -1
    backend: str | None = None
    timeout_s: float = 600.0
    world_size: int | None = None

    def __post_init__(self) -> None:
        build_now = self.world_size is None
        if build_now:
            self.world_size = _current_world_size()
        self.dp = _resolve_dp(self.world_size, self.tp, self.pp, self.dp)
        self._rank: int | None = None
        self._pg: dict[str, ProcessGroup] = {}
        if build_now:
            self.build()

    @classmethod
    def from_layout(cls, layout: MeshShape, **kw) -> ParallelDims:
        """The mesh of ``layout``'s ``tp``, ``pp`` and ``dp`` (a ``ParallelConfig``, a planner
        ``Layout``, ...; read by attribute, so this layer imports neither). ``kw``: the
        other arguments (``backend``, ``timeout_s``, ``world_size``)."""
        return cls(tp=layout.tp, pp=layout.pp, dp=layout.dp, **kw)

    def build(self) -> ParallelDims:
        """Create the process groups, starting ``torch.distributed`` first if it is not
        running (from torchrun's environment, or as a 1-rank world). Collective: every rank
        of the world calls it. Returns ``self``; a second call does nothing."""
        if self._rank is not None:
            return self
        world = _current_world_size()
        if world != self.world_size:
            raise ValueError(
                f"world_size={self.world_size}, but the job has {world} ranks: pass "
                f"world_size={world} (or leave it out to take the job's)"
            )
        if not dist.is_initialized():
            _init_from_env(self.backend, self.timeout)
        elif (backend_for(None, "cuda") == "nccl" and torch.cuda.is_available()
              and "RANK" in os.environ and torch.cuda.current_device() == 0
              and (local := _local_device()) != 0):
            # a world started by the caller, whose rank never chose its GPU (it is on the
            # default, GPU 0): this rank's own, as torchrun's LOCAL_RANK names it (a rank
            # that chose one keeps it)
            torch.cuda.set_device(local)
        for name, rank_lists in self.groups.items():
            # every rank takes part in creating every group, in the same order; each with
            # the job's timeout (torch gives a subgroup its 30-minute default otherwise, and
            # a stalled rank would hold a wait on a TP, PP or DP group that long)
            self._pg[name], _ = dist.new_subgroups_by_enumeration(
                rank_lists, timeout=self.timeout)
        self._rank = dist.get_rank()
        return self

    @property
    def timeout(self) -> datetime.timedelta:
        """The collective timeout of every group this mesh creates (``timeout_s``)."""
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def is_built(self) -> bool:
        """Whether :meth:`build` has created the process groups."""
        return self._rank is not None

    @cached_property
    def groups(self) -> dict[str, list[list[int]]]:
        """Rank lists of every group of this mesh (see :func:`mesh_groups`)."""
        return mesh_groups(self.world_size, self.tp, self.pp, self.dp)

    def _built(self) -> None:
        if self._rank is None:
            raise RuntimeError(
                f"ParallelDims(tp={self.tp}, pp={self.pp}, dp={self.dp}, "
                f"world_size={self.world_size}) has only validated its sizes: call .build() "
                f"on every rank before using its rank, coordinates or process groups"
            )

    # --- coordinates -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank (once built)."""
        self._built()
        return self._rank

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of global ``rank`` (pure arithmetic)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: choose a rank in 0..{self.world_size - 1}")
        return (rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp)

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of this rank."""
        return self.coords_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    # --- groups ------------------------------------------------------------------------
    def _group(self, name: str) -> ProcessGroup:
        self._built()
        return self._pg[name]

    @property
    def tp_group(self) -> ProcessGroup:
        return self._group("tp")

    @property
    def dp_group(self) -> ProcessGroup:
        return self._group("dp")

    @property
    def pp_group(self) -> ProcessGroup:
        return self._group("pp")

    @property
    def model_parallel_group(self) -> ProcessGroup:
        """All ranks holding one replica of the model (pp x tp)."""
        return self._group("pp_tp")

    @property
    def world_group(self) -> ProcessGroup:
        self._built()
        return dist.group.WORLD

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group ``name`` (``tp``, ``dp``, ``pp``, ``pp_tp``)."""
        rank = self.rank
        return next(g for g in self.groups[name] if rank in g)

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
        self._built()
        return group_device()

    def __deepcopy__(self, memo: dict) -> ParallelDims:
        """The mesh itself: a handle on the job's process groups, which a copy of a model
        (an EMA, a reference) shares; they cannot be copied."""
        return self

    def __repr__(self) -> str:
        where = f"rank={self._rank}, coords(pp,dp,tp)={self.coords}" if self.is_built else (
            "not built")
        return (
            f"ParallelDims(tp={self.tp}, pp={self.pp}, dp={self.dp}, "
            f"world_size={self.world_size}, {where})"
        )
