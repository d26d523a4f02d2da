"""What a run's model state needs per rank at the least, checked before any rank builds it.

The weights, gradients and AdamW's two moments (and, in bfloat16, the fp32 master weights)
are held for the whole run; activations, buckets and workspace come on top. Their bytes on
the busiest rank are at least ``P / (tp * pp)`` parameters' worth, each part divided by
``dp`` where ZeRO shards it. When that lower bound alone exceeds the memory a rank can have
(a GPU's; on CPU the machine's memory over the ranks started on it), the run cannot fit, and
:func:`check_fits` says so naming the knobs, instead of the allocator's traceback (or, for
millions of blocks, minutes spent building modules that cannot fit)."""

from __future__ import annotations

import os
import re

from distllm.models.config import GPTConfig
from distllm.parallel.mesh import LOCAL_RANK_VARS

__all__ = ["state_bytes_per_rank", "memory_per_rank",
           "ranks_on_this_machine", "check_fits"]

_GIB = 2 ** 30


def state_bytes_per_rank(mcfg: GPTConfig, dtype: str, *, tp: int, pp: int, dp: int,
                         zero: int) -> float:
    """A lower bound on the bytes of model state on the busiest rank (see the module's
    docstring): weights, gradients, optimizer moments and master weights."""
    width = {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
    state = 8 if dtype == "float64" else 4  # AdamW's moments and the masters: fp32 or fp64
    masters = 4 if dtype == "bfloat16" else 0
    per = mcfg.num_params() / (tp * pp)
    weights = width / (dp if zero >= 3 else 1)
    grads = width / (dp if zero >= 2 else 1)
    optim = (2 * state + masters) / (dp if zero >= 1 else 1)
    return per * (weights + grads + optim)


_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _env_int(names: tuple[str, ...], default: int) -> int:
    """The first of the environment variables ``names`` that is set, as an integer (SLURM's
    ``4(x2)`` reads 4), else ``default``."""
    for name in names:
        m = re.match(r"\s*(\d+)", os.environ.get(name, ""))
        if m:
            return int(m.group(1))
    return default


def ranks_on_this_machine() -> int:
    """The ranks this machine runs, as torchrun (``LOCAL_WORLD_SIZE``), srun or mpirun say;
    1 where none does (the check then never refuses for the ranks it cannot see)."""
    return max(1, _env_int(_LOCAL_SIZE, 1))


def memory_per_rank(ranks_here: int) -> tuple[float, str]:
    """The bytes one rank can have, and where they are: a GPU's memory, or this machine's
    physical memory over the ``ranks_here`` ranks it runs."""
    import torch

    if torch.cuda.is_available():
        # this rank's own GPU (a property read: no context on another rank's GPU), numbered
        # as distllm.parallel.mesh picks it
        gpu = _env_int(LOCAL_RANK_VARS, 0) % torch.cuda.device_count()
        return float(torch.cuda.get_device_properties(gpu).total_memory), "a GPU"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if ranks_here <= 1:
        return float(total), "this machine's memory"
    return total / ranks_here, f"this machine's memory shared by its {ranks_here} ranks"


def check_fits(mcfg: GPTConfig, dtype: str, *, model: str, tp: int, pp: int, dp: int,
               zero: int, ranks_here: int) -> None:
    """A ValueError naming the knobs when the model state alone cannot fit in a rank (at
    ZeRO-3 its shard: the engine never holds the stage whole, see
    :class:`distllm.train.engine.Engine`)."""
    need = state_bytes_per_rank(mcfg, dtype, tp=tp, pp=pp, dp=dp, zero=zero)
    have, where = memory_per_rank(ranks_here)
    if need <= have:
        return
    raise ValueError(
        f"--model {model} with {mcfg.n_layers} blocks ({mcfg.num_params() / 1e6:,.0f}M "
        f"parameters) needs at least {need / _GIB:,.1f} GiB per rank for its {dtype} weights, "
        f"gradients and AdamW states at tp{tp}.pp{pp}.dp{dp}.zero{zero}, more than the "
        f"{have / _GIB:,.1f} GiB of {where}: lower --n-layers or choose a smaller --model, or "
        f"split the model over more ranks (--tp, --pp, or --zero with --dp)")
