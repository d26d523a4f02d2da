"""Small files written whole or not at all: :func:`write_text_atomic`, the one writer of the
package's JSON, Markdown and CSV outputs (bench results, profiles, the autotune cache)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic", "umask"]


def umask() -> int:
    """The process's umask, read without setting it where Linux shows it (``/proc``): the
    ``os.umask`` pair that reads it elsewhere sets it to 0 for a moment, for every thread."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """``text`` into ``path`` through a temporary file beside it, renamed over it: a reader,
    or a process killed while writing, never sees half a file. The temporary file's name is
    unique (two writers of one path do not share it), and it gets the permissions a file
    made with ``open`` under the umask would (not ``mkstemp``'s owner-only ones). A write that
    fails removes its temporary file, leaves ``path`` as it was, and raises."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:  # (closes the file whatever happens)
            os.fchmod(f.fileno(), 0o666 & ~umask())
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
