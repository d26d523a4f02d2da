"""A run killed while it writes a file, for the tests of what the bench writes: from
:func:`half_writes` on, every file opened for writing takes the first half of what is
written to it, then the write raises :class:`Killed`."""

from __future__ import annotations

import builtins
import io


class Killed(Exception):
    """The run ended while a file was being written."""


class _HalfFile:
    def __init__(self, f) -> None:
        self._f = f

    def write(self, text: str) -> int:
        self._f.write(text[: len(text) // 2])
        self._f.flush()
        raise Killed(f"killed while writing {self._f.name}")

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _HalfFile:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def half_writes(monkeypatch) -> None:
    """Every ``open(..., "w")`` (``pathlib``'s too) from here on writes half, then raises."""
    real = builtins.open

    def opener(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return _HalfFile(f) if "w" in mode else f

    monkeypatch.setattr(builtins, "open", opener)
    monkeypatch.setattr(io, "open", opener)
