"""A folder a command writes whole or not at all (``distllm export``, ``distllm tokenize``)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from distllm.files import umask
from distllm.train.checkpoint_folder import sync_dir

__all__ = ["new_folder", "write_failed"]


@contextlib.contextmanager
def new_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside ``dest`` to write into, renamed to ``dest`` when the block
    ends, removed when it raises: a failed command leaves nothing. Every file and folder in
    it is synced to the device before the rename, and ``dest``'s parent after it, so that
    after a crash ``dest`` is whole or absent. ``dest`` must not exist or be an empty
    folder, and must be creatable (ValueError naming DEST). The folder has
    the permissions of one made with ``mkdir`` under the umask (``mkdtemp``'s are the
    owner's alone), its files those of files made with ``open`` (a writer may have made
    them the owner's alone: transformers' ``save_pretrained``)."""
    shown, dest = dest, Path(os.path.abspath(dest))  # "." and "a/.." have a name and a parent
    if dest == Path.cwd():
        raise ValueError(f"DEST {shown} is the current folder; pass a new folder")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"DEST {shown} exists; pass a new folder")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as exc:  # a file on the way, a folder that cannot be written
        why = exc.strerror or str(exc)
        if (file := _file_on_the_way(dest.parent)) is not None:
            why = f"{file} is a file, not a folder"
        raise ValueError(f"DEST {shown}: cannot create a folder there ({why}); pass another "
                         f"DEST") from None
    mask = umask()
    tmp.chmod(0o777 & ~mask)
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                f.chmod(0o666 & ~mask)
        _sync_tree(tmp)
        try:
            if dest.exists():
                dest.rmdir()  # empty (checked above)
            os.replace(tmp, dest)
        except OSError as exc:  # another command filled DEST meanwhile: its folder stays
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise ValueError(f"DEST {shown} exists; pass a new folder") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_dir(dest.parent)  # the rename itself


def _sync_tree(root: Path) -> None:
    """Make the folder ``root`` durable before it is renamed into place: every regular file
    under it, then every folder under it (the names of their entries), deepest first, then
    ``root`` itself. Symbolic links are not followed."""
    paths = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for f in paths:
        if f.is_file() and not f.is_symlink():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in paths:
        if d.is_dir() and not d.is_symlink():
            sync_dir(d)
    sync_dir(root)


def _file_on_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, if it is not a folder."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def write_failed(dest: str | os.PathLike, exc: Exception) -> ValueError:
    """The one-line error of a write into :func:`new_folder`'s folder that failed (a full
    disk, a failing device: an OSError, or a writer's own error saying so), naming DEST."""
    why = getattr(exc, "strerror", None) or exc
    return ValueError(f"DEST {dest}: cannot write there ({why}); free some space, or pass "
                      f"another DEST")
