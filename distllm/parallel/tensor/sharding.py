"""How a tensor-parallel parameter is made: the full tensor initialised alike on every rank,
this rank's block of it, Megatron's attributes on the result, and the divisibility check
whose error names the knob."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["check_divisible", "shard", "init_full_weight", "mark_tensor_parallel",
           "mark_sequence_parallel"]


def check_divisible(n: int, tp: int, what: str, knob: str) -> None:
    """Raise a ValueError naming ``knob`` unless ``tp`` divides ``n``."""
    if n % tp:
        ok = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
        raise ValueError(f"{what}={n} is not divisible by tp={tp}: choose {knob} divisible by "
                         f"{tp}, or tp in {ok}")


def shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous block of ``t`` along ``dim`` (a copy)."""
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).clone().contiguous()


def init_full_weight(shape: tuple[int, ...], fan_in: int, init_method: Callable | None,
                     dtype: torch.dtype | None, device: torch.device | str | None
                     ) -> torch.Tensor:
    """The full (unsharded) tensor, initialised identically on every rank given the same seed
    (``init_method(t)`` in place; default ``nn.Linear``'s uniform(+-1/sqrt(fan_in))), so a
    model's initial weights do not depend on tp."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if init_method is not None:
        init_method(t)
    else:
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(t, -bound, bound)
    return t


def mark_tensor_parallel(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    """Megatron's attributes of a sharded parameter (``tensor_model_parallel`` and
    ``partition_dim``): grad-norm code counts it on every rank, replicated ones once."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    return p


def mark_sequence_parallel(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A replicated parameter applied to a sequence shard. Its gradient is already
    all-reduced over tp inside the module (nothing for the trainer to do)."""
    p.sequence_parallel = True
    return p
