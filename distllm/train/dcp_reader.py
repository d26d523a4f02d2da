"""Reading a DCP checkpoint's ``.metadata`` without letting it run code.

DCP's own file-system reader ``pickle.load``s the metadata, and ``torch.load``s with
``weights_only=False`` any entry that is not a tensor: a crafted checkpoint could run code
on every rank that loads it. :class:`RestrictedReader` reads it through
:class:`MetadataUnpickler`, which allows only the classes DCP metadata holds, and refuses
entries that are not tensors (distllm saves tensors only). A refused file is a
:class:`Refused` error naming the file and what it asked for.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["Garbled", "MetadataUnpickler", "Refused", "RestrictedReader", "read_metadata"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"  # its classes are allowed
# what else the .metadata of a distllm checkpoint pickles: shapes (torch.Size), the layout
# (torch.strided pickles as _get_layout("torch.strided")), DCP's file offsets (_StorageInfo)
# and the checkpoint's path; and torch dtypes (see MetadataUnpickler.find_class)
_PICKLED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            *((m, c) for m in ("pathlib", "pathlib._local")
              for c in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                        "PureWindowsPath"))}


class Refused(pickle.UnpicklingError, ValueError):
    """Checkpoint metadata that is not loaded; the message names the file and why (a
    ValueError too: ``distllm train`` reports it in one line, exit code 2)."""


class Garbled(ValueError):
    """Checkpoint metadata cut short or overwritten: a damaged checkpoint, which the loader
    reports naming the complete one before it (unlike :class:`Refused`, which is a file that
    asks for what metadata never holds)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: ``find_class`` returns only the classes of
    ``torch.distributed.checkpoint.metadata``, torch dtypes and :data:`_PICKLED`, so a
    crafted file cannot name a callable to run."""

    def __init__(self, file, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        obj = getattr(dcp_metadata, name, None) if module == _DCP_METADATA else None
        if ((module, name) in _PICKLED
                or (isinstance(obj, type) and obj.__module__ == _DCP_METADATA)
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise Refused(
            f"{self.source} asks to unpickle {module}.{name}, which checkpoint metadata never "
            f"holds: refusing to load it (a damaged or crafted checkpoint: pass another --out)")


def read_metadata(file: Path) -> dcp_metadata.Metadata:
    """The DCP metadata in ``file``, unpickled by :class:`MetadataUnpickler`, whose entries
    must all be tensors."""
    with open(file, "rb") as f:
        try:
            md = MetadataUnpickler(f, file).load()
        except Refused:
            raise
        except Exception as e:  # a truncated or garbled file
            raise Garbled(f"{file.name} is not checkpoint metadata ({type(e).__name__}: "
                          f"{e})") from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise Garbled(f"{file.name} holds a {type(md).__name__}, not checkpoint metadata")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise Refused(
                f"{file}: entry {fqn!r} is a {type(entry).__name__}, not a tensor (distllm "
                f"saves tensors only, and DCP would unpickle it without restriction): refusing "
                f"to load it (a damaged or crafted checkpoint: pass another --out)")
    return md


class RestrictedReader(dcp.FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata` as ``read_metadata``: it reads
    the checkpoint's ``.metadata`` (``__{rank}.metadata`` when DCP asks for a rank's own),
    each file unpickled once (``load_latest`` reads it before ``dcp.load`` reads it again)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._dir = Path(path)
        self._read: dict[Path, dcp_metadata.Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._dir = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        file = self._dir / (".metadata" if rank is None else f"__{rank}.metadata")
        if file not in self._read:
            self._read[file] = read_metadata(file)
        md = self._read[file]
        load_id = getattr(self, "load_id", None)  # DCP's reader tags the metadata it returns
        if load_id is not None and hasattr(md, "storage_meta"):
            if md.storage_meta is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = load_id
        return md
