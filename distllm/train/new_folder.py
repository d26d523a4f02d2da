"""A folder a command writes whole or not at all (``distllm export``, ``distllm tokenize``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["new_folder"]


@contextlib.contextmanager
def new_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside ``dest`` to write into, renamed to ``dest`` when the block
    ends, removed when it raises: a failed command leaves nothing. ``dest`` must not exist
    or be an empty folder, and must be creatable (ValueError naming DEST). The folder has
    the permissions of one made with ``mkdir`` under the umask (``mkdtemp``'s are the
    owner's alone), its files those of files made with ``open`` (a writer may have made
    them the owner's alone: transformers' ``save_pretrained``)."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"DEST {dest} exists; pass a new folder")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as exc:  # a file on the way, a folder that cannot be written
        why = exc.strerror or str(exc)
        if (file := _file_on_the_way(dest.parent)) is not None:
            why = f"{file} is a file, not a folder"
        raise ValueError(f"DEST {dest}: cannot create a folder there ({why}); pass another "
                         f"DEST") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                f.chmod(0o666 & ~umask)
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _file_on_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, if it is not a folder."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None
