"""A layout (one point of the search) and its estimate (the cost model's predictions).

A training run's config converts to a :class:`Layout` with :meth:`Layout.from_config`; the
other way is :meth:`distllm.train.config.ParallelConfig.from_layout`, and the mesh of either
is :meth:`distllm.parallel.mesh.ParallelDims.from_layout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from distllm.parallel.mesh import ParallelDims

__all__ = ["Layout", "Estimate", "GB", "grad_buffers_text"]

GB = 1e9


class Layout(NamedTuple):
    """One parallel layout of a training step (a tuple: cheap to make by the ten thousand)."""

    tp: int
    pp: int
    dp: int
    zero: int = 0
    schedule: str = "none"
    """``none`` (pp=1: plain gradient accumulation), gpipe, 1f1b, interleaved-1f1b, zb-h1."""
    micro_batches: int = 1
    """Micro-batches per step and DP rank."""
    checkpointing: str = "none"
    """Activation recomputation: none, selective (attention core) or full (every block)."""
    sequence_parallel: bool = False
    virtual_stages: int = 1
    """Model chunks per rank (interleaved-1f1b)."""

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> Layout:
        """The layout a training run uses on ``world_size`` ranks (``dp=-1`` resolved).

        ``cfg`` is a :class:`distllm.train.config.TrainConfig`, read by attribute (its
        ``parallel`` fields and ``activation_checkpointing``), so that the planner does not
        import the trainer.
        """
        p = cfg.parallel
        dp = ParallelDims.from_layout(p, world_size=world_size).dp
        pipelined = p.pp > 1
        return cls(p.tp, p.pp, dp, p.zero, p.schedule if pipelined else "none",
                   p.micro_batches, cfg.activation_checkpointing, p.sequence_parallel,
                   p.chunks_per_rank)

    def name(self) -> str:
        s = f"tp{self.tp}.pp{self.pp}.dp{self.dp}.zero{self.zero}"
        if self.pp > 1 and self.schedule != "none":  # none: a layout rejected before scheduling
            s += f".{self.schedule}" + (
                f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            )
        s += f".m{self.micro_batches}"
        if self.checkpointing != "none":
            s += f".ckpt-{self.checkpointing}"
        return s + (".sp" if self.sequence_parallel else "")


@dataclass
class Estimate:
    """Predictions for one layout; bytes per device and seconds per step."""

    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)
    """params, grads, optimizer, activations, total (bytes)."""
    time: dict[str, float] = field(default_factory=dict)
    """step and its parts (compute, tp_comm, bubble, dp_comm, zero_comm, optimizer, ...)."""
    step_time_s: float = math.inf
    mfu: float = 0.0
    rejected_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = self.layout._asdict()
        d.update(
            memory_gb={k: round(v / GB, 6) for k, v in self.memory.items()},
            step_time_s=None if math.isinf(self.step_time_s) else self.step_time_s,
            mfu=self.mfu if self.step_time_s < math.inf else None,
            time_s=self.time or None,
            rejected_reason=self.rejected_reason,
            notes=self.notes,
        )
        return d


def grad_buffers_text(mem: dict[str, float]) -> str:
    """``", grad buffers X"`` (GB) of a memory breakdown where ZeRO-2/3 accumulates
    micro-batches in full-size gradient buffers, else nothing."""
    buf = mem.get("grad_buffers", 0.0)
    return f", grad buffers {buf / GB:.3g} (full-size, accumulating micro-batches)" if buf else ""
