"""How the tests combine errors: :func:`worst` is ``max`` that keeps a NaN.

Python's ``max`` drops a NaN unless it comes first (``max(1e-12, nan)`` is ``1e-12``), so a
parity test that folds its per-tensor errors with it passes a NaN gradient or weight."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["worst"]


def worst(*errs: float | Iterable[float]) -> float:
    """The largest of ``errs`` (several numbers, or one iterable of them, as for ``max``),
    with a NaN counted as ``inf``. An empty iterable is an error: nothing was compared."""
    values = [float(e) for e in (errs[0] if len(errs) == 1 else errs)]
    if not values:
        raise ValueError("worst(): no errors to combine (the test compared nothing)")
    return max(math.inf if math.isnan(v) else v for v in values)
