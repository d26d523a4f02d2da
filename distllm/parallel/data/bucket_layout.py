"""How parameters are laid out in gradient buckets: which parameters share a bucket
(:func:`assign_buckets`), each bucket's flat layout and state (:class:`Bucket`), and the
sizes (:data:`FIRST_BUCKET_BYTES`, :func:`bucket_bytes`). The reduction over them is
:class:`~distllm.parallel.data.buckets.GradBuckets`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Bucket", "assign_buckets", "bucket_bytes", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1024 * 1024  # same first-bucket size as torch DDP


def bucket_bytes(name: str, mb: Any, default: float) -> int:
    """The bytes of a bucket size given in MB by the argument ``name``: a finite number > 0,
    else a ValueError naming it."""
    try:
        ok = math.isfinite(mb) and mb > 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name}={mb!r}: give a finite number of MB > 0 ({default:g} is the "
                         f"default)")
    return int(mb * 2**20)


def assign_buckets(params: list[torch.nn.Parameter], cap_bytes: int,
                   first_cap_bytes: int = FIRST_BUCKET_BYTES,
                   key: Callable[[torch.nn.Parameter], object] | None = None,
                   elem_size: int | None = None) -> list[list[torch.nn.Parameter]]:
    """Group ``params`` (given in registration order) into buckets, last parameter first.

    A bucket closes when adding the next parameter would pass its cap (``first_cap_bytes``
    for bucket 0, ``cap_bytes`` after) and it holds at least half of it; a parameter larger
    than the cap closes the bucket it joins. So a few small parameters ahead of a large one
    (a bias registered after its weight, when the weight passes the cap) share its bucket
    instead of making a bucket of their own, a collective for a few bytes: at gpt2-xl's
    width, whose MLP weights pass the default 25 MiB, the ZeRO buckets of the trainer's
    groups (which share buckets) were 292, 97 of them under 64 KB, and are 147 with this
    rule, none under 64 KB. Parameters whose ``key`` differs (dtype, optimizer param group)
    never share a bucket. ``elem_size`` overrides the bytes per element (e.g. 4 for fp32
    reduction).
    """
    key = key or (lambda p: p.dtype)
    buckets: list[list[torch.nn.Parameter]] = []
    open_: dict[object, tuple[list, int]] = {}  # key -> (params, bytes)
    for p in reversed(params):
        k = key(p)
        cur, nbytes = open_.get(k, ([], 0))
        size = p.numel() * (elem_size or p.element_size())
        # an open bucket 0 has not reached its own cap, so only the general one closes early
        if cur and nbytes + size > cap_bytes and 2 * nbytes >= cap_bytes:
            buckets.append(cur)
            cur, nbytes = [], 0
        cur.append(p)
        nbytes += size
        if nbytes >= (first_cap_bytes if not buckets else cap_bytes):  # full (or passed)
            buckets.append(cur)
            cur, nbytes = [], 0
        open_[k] = (cur, nbytes)
    buckets.extend(b for b, _ in open_.values() if b)
    return buckets


@dataclass(eq=False)
class Bucket:
    """One flat bucket: ``params`` laid out back to back, padded to ``numel``."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]  # start of each param inside the flat buffer
    shapes: list[torch.Size]  # each param's shape (kept: ZeRO-3 empties params while sharded)
    numel: int  # padded length (a multiple of the group size in reduce_scatter mode)
    buffer: Tensor | None = None  # full bucket (reduce dtype); None while freed
    shard: Tensor | None = None  # reduce_scatter mode: this rank's reduced slice
    ready: set[int] = field(default_factory=set)  # indices of params whose grad landed
    launched: bool = False
    work: object = None
    out: Tensor | None = None  # reduce_scatter output, added into ``shard`` on completion
    fresh: bool = True  # the buffer holds nothing of this cycle yet
    written: set[int] = field(default_factory=set)  # slices holding this cycle's gradient
    scaled: set[int] = field(default_factory=set)  # written slices already divided by nranks
    shard_fresh: bool = True
    nranks: int = 1  # size of the group the bucket is reduced over

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's slice of the (padded) bucket."""
        return self.numel // self.nranks
