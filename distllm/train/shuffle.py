"""A shuffled order of ``n`` items computed per position, in memory independent of ``n``.

:class:`Permutation` maps positions ``0..n-1`` to a permutation of ``0..n-1`` chosen by a
seed: a Feistel network over ``bits`` bits (``2**bits`` at least ``n``, ``bits`` even; its
round function a keyed 64-bit integer hash, the keys drawn from the seed), a bijection of
``[0, 2**bits)`` whatever the round function, restricted to ``[0, n)`` by cycle walking (an
image at or past ``n`` is mapped again until it falls below ``n``; since ``2**bits < 4n``,
fewer than 4 times on average). A block of 65,536 positions costs a few integer operations
per position and 512 KiB, where ``torch.randperm(n)`` holds ``8n`` bytes and takes seconds
per billion items, on every rank at each epoch (a corpus of 2T tokens in windows of 2048
tokens: 1G windows, 8 GB). Up to one block of items it is ``torch.randperm(n)`` itself:
over a few bits a Feistel network gives only some of the permutations, not evenly.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Permutation"]

_ROUNDS = 6
_U = np.uint64
BLOCK = 1 << 16
"""Positions :meth:`Permutation.range` computes at once (512 KiB of int64)."""


def _hash(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A keyed 64-bit mix of ``x`` (uint64, wrapping products: splitmix64's finaliser)."""
    h = (x ^ key) * _U(0x9E3779B97F4A7C15)
    h ^= h >> _U(30)
    h *= _U(0xBF58476D1CE4E5B9)
    h ^= h >> _U(27)
    h *= _U(0x94D049BB133111EB)
    return h ^ (h >> _U(31))


class Permutation:
    """A seeded permutation of ``range(n)``: ``perm(positions)`` gives the items at those
    positions (an int64 tensor of the same shape). Two instances of the same ``n`` and
    ``seed`` agree on every process."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        bits = (n - 1).bit_length()
        self.bits = max(2, bits + (bits & 1))
        g = torch.Generator().manual_seed(seed)
        # up to a block, a table: torch.randperm's uniform order (a Feistel network over a
        # few bits can give only some of the permutations, unevenly)
        self._table = torch.randperm(n, generator=g) if n <= BLOCK else None
        self.keys = [_U(k) for k in torch.randint(0, 2**62, (_ROUNDS,), generator=g).tolist()]
        self._block: tuple[int, torch.Tensor] | None = None

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        half = _U(self.bits // 2)
        mask = (_U(1) << half) - _U(1)
        left, right = x >> half, x & mask
        for key in self.keys:
            left, right = right, left ^ (_hash(right, key) & mask)
        return (left << half) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The items at ``positions`` (an int tensor of any shape, of positions in
        ``[0, n)``; IndexError for one outside)."""
        x = np.atleast_1d(positions.numpy().astype(np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions outside 0..{self.n - 1}")
        if self._table is not None:
            return self._table[torch.from_numpy(x)].reshape(positions.shape)
        out = self._feistel(x.astype(np.uint64))
        walk = out >= _U(self.n)
        while walk.any():  # cycle walking: back into [0, n)
            out[walk] = self._feistel(out[walk])
            walk = out >= _U(self.n)
        return torch.from_numpy(out.astype(np.int64)).reshape(positions.shape)

    def range(self, lo: int, hi: int) -> torch.Tensor:
        """The items at positions ``[lo, hi)`` (``0 <= lo <= hi <= n``, else IndexError),
        from a cached block of :data:`BLOCK` positions when the range lies in one (a
        loader's batches: one computation per block, not per batch)."""
        if not 0 <= lo <= hi <= self.n:
            raise IndexError(f"positions [{lo}, {hi}) outside 0..{self.n - 1}")
        if self._table is not None:
            return self._table[lo:hi]
        b = lo // BLOCK
        if hi <= lo or (hi - 1) // BLOCK != b:
            return self(torch.arange(lo, hi))
        if self._block is None or self._block[0] != b:
            self._block = (b, self(torch.arange(b * BLOCK, min((b + 1) * BLOCK, self.n))))
        return self._block[1][lo - b * BLOCK: hi - b * BLOCK]
