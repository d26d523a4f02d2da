"""Training data: a byte-level tokenizer, the default corpus, and a resumable DP-aware loader.

The default corpus is the Python standard library's own ``.py`` sources, read from the
running interpreter's installation (``sysconfig.get_paths()["stdlib"]``): real text present on
every machine with Python, deterministic for a given Python version. Files are read in sorted
order and joined with a blank line; the last ``val_fraction`` of the bytes is held out for the
validation loss.

Pre-tokenized data: a ``.bin`` file of token ids, as nanoGPT's ``prepare.py`` writes them
(the ids back to back, little-endian, no header; ``uint16`` by default, ``uint32`` with
``--data-dtype`` for vocabularies past 65,536), read through a memory map, so that a file
larger than memory trains. ``--data`` names the file (its last ``val_fraction`` held out), or
a folder holding ``train.bin`` and, for the validation loss, ``val.bin`` (else ``train.bin``'s
tail is held out). The ids must fit the model's vocabulary: the loader checks each batch.

The loader cuts the training tokens into windows of ``seq_len + 1`` tokens (inputs and
targets shifted by one) that start ``seq_len`` apart, so that each window's last token is the
next one's first (a target there, an input here), shuffles the windows once per epoch by a
permutation seeded by ``(seed, epoch)`` (:class:`~distllm.train.shuffle.Permutation`, computed
a block at a time: no table of every window), and hands out global batches in that order; DP rank
``r`` takes rows ``[r*B/dp, (r+1)*B/dp)`` of each global batch ``B``. The order depends only
on the seed and the global batch, never on the layout, so every layout sees the same data. Its
position (``epoch``, ``index``) is a small state dict that a checkpoint saves and restores.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from distllm.train.shuffle import Permutation

if TYPE_CHECKING:
    from distllm.parallel.mesh import ParallelDims

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "load_corpus",
    "BatchLoader",
    "default_corpus_files",
    "TOKEN_DTYPES",
    "check_vocab",
    "data_source",
    "tokens_of",
    "check_same_data",
    "fingerprint",
]

TOKEN_DTYPES = ("uint16", "uint32")
"""The dtypes of a ``.bin`` file's token ids (``--data-dtype``)."""

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".json", ".csv", ".c", ".h", ".html", ".tex")


class ByteTokenizer:
    """Byte-level tokenizer: token ``i`` is byte ``i``; 256 tokens, no merges, lossless."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of the bytes ``ids``; a byte sequence that is not UTF-8, and an id that is
        not a byte (outside 0..255: a model of a larger vocabulary), each read as U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        runs: list[list[int]] = [[]]  # the byte runs between ids that are not bytes
        for v in values:
            if 0 <= int(v) < self.vocab_size:
                runs[-1].append(int(v))
            else:
                runs.append([])
        return "\ufffd".join(bytes(r).decode("utf-8", errors="replace") for r in runs)


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files of the running interpreter, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"the Python standard library folder {root} is missing, so there is no default "
            f"corpus: pass --data PATH (a text file or a folder of text files)"
        )
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _files_of(path: str, knob: str = "--data", skip: str | None = None) -> list[Path]:
    """The text files ``--data path`` (``knob``) names: the file, or the folder's, sorted;
    ``skip``: a folder under it to leave out (a run's own ``--out``: :func:`load_corpus`)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{knob} {path}: no such file or folder")
    if p.is_file():
        return [p]
    # the run's folder, and its checkpoints where --out is the data folder itself
    left_out = () if skip is None else (Path(skip).resolve(), Path(skip).resolve() / "checkpoints")
    files = sorted(f for f in _walk(p, path, knob, left_out)
                   if f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"{knob} {path}: the folder holds no text files "
                         f"({', '.join(TEXT_SUFFIXES)})")
    return files


def _walk(folder: Path, path: str, knob: str, skip: tuple[Path, ...] = ()) -> Iterator[Path]:
    """The files under ``folder`` (links to folders not followed, as ``Path.rglob``), but
    for those under the folders ``skip`` (resolved); one that cannot be read is refused,
    naming it (``rglob`` left it out without a word)."""
    try:
        with os.scandir(folder) as it:
            entries = list(it)
        found = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if Path(e.path).resolve() not in skip:
                    found.append(Path(e.path))
            elif e.is_file():
                os.stat(e.path)  # (in a folder that can be listed but not entered: EACCES)
                yield Path(e.path)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else folder
        raise ValueError(f"{knob} {path}: cannot read {where} ({exc.strerror or exc}): make it "
                         f"readable or move it out of the folder") from None
    for sub in found:
        yield from _walk(sub, path, knob, skip)


@dataclass
class Corpus:
    """Token ids of the training and validation parts and where they came from: uint8 CPU
    tensors of a text's bytes, or read-only memory maps of a ``.bin`` file's ids."""

    train: torch.Tensor | np.ndarray
    val: torch.Tensor | np.ndarray
    source: str
    n_files: int


def _held_out(n: int, val_fraction: float) -> int:
    """How many of ``n`` ids (the last) are held out for validation."""
    return max(int(n * val_fraction), min(n // 2, 4096))


def _token_files(path: str) -> tuple[Path, Path | None] | None:
    """``(train, val or None)`` where ``path`` is a ``.bin`` file or a folder holding
    ``train.bin``, else None (text)."""
    p = Path(path)
    train = p / "train.bin" if p.is_dir() else p
    if not (train.is_file() and train.suffix.lower() == ".bin"):
        return None
    val = train.with_name("val.bin")
    return train, val if train.name == "train.bin" and val.is_file() else None


def data_source(path: str | None) -> str:
    """Which data ``--data path`` names, as a checkpoint records it: the default corpus's
    name, or the path made absolute (so that a resume from another folder compares it)."""
    return "python-stdlib" if path is None else str(Path(path).resolve())


def tokens_of(path: str | None) -> str:
    """What ``--data path`` (None: the default corpus) trains on: ``"ids"`` (a ``.bin``
    file's, a tokenizer's) or ``"bytes"`` (text)."""
    return "ids" if path is not None and _token_files(path) is not None else "bytes"


def _memmap(f: Path, dtype: str, path: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = f.stat().st_size
    if size % itemsize:
        raise ValueError(f"--data {path}: {f.name} holds {size} bytes, not a whole number of "
                         f"{dtype} token ids; check --data-dtype ({', '.join(TOKEN_DTYPES)})")
    if size == 0:
        return np.zeros(0, dtype=dtype)  # numpy cannot map an empty file
    return np.memmap(f, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def _load_tokens(path: str, files: tuple[Path, Path | None], dtype: str, val_fraction: float,
                 min_tokens: int) -> Corpus:
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--data-dtype {dtype}: choose one of {', '.join(TOKEN_DTYPES)}")
    train_f, val_f = files
    ids = _memmap(train_f, dtype, path)
    if len(ids) < min_tokens:
        raise ValueError(f"--data {path}: {train_f.name} holds {len(ids)} token ids, too few to "
                         f"train on (need at least {min_tokens}); pass a bigger file")
    if val_f is not None:
        train, val = ids, _memmap(val_f, dtype, path)
        if len(val) == 0:
            raise ValueError(f"--data {path}: {val_f.name} is empty; fill it, or remove it "
                             f"(the tail of {train_f.name} is then held out)")
    else:
        n_val = _held_out(len(ids), val_fraction)
        train, val = ids[:-n_val], ids[-n_val:]
    return Corpus(train=train, val=val, source=os.fspath(path), n_files=1 + (val_f is not None))


MIN_TOKENS = 64
"""The fewest tokens ``--data`` may hold: the text's bytes, or the ids of its ``.bin`` file
(``train.bin`` of a folder), counted before the validation part is held out (``distllm
tokenize`` writes no fewer to ``train.bin``)."""


def load_corpus(path: str | None = None, *, val_fraction: float = 0.02,
                min_tokens: int = MIN_TOKENS,
                dtype: str = "uint16", skip: str | None = None) -> Corpus:
    """Read ``path`` (a file, a folder, or None for the standard library) into token ids:
    text as bytes, or a ``.bin`` file of ``dtype`` token ids (see the module's docstring).
    ``skip``: a folder under a ``path`` folder that is not data, the run's own ``--out``
    (``--data .`` with ``--out runs/train``: its checkpoints' meta.json files are text, and a
    resume trained on them)."""
    if path is not None and (tokens := _token_files(path)) is not None:
        return _load_tokens(path, tokens, dtype, val_fraction, min_tokens)
    files = default_corpus_files() if path is None else _files_of(path, skip=skip)
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError as exc:
            if path is None:  # the standard library's: one file fewer changes nothing
                continue
            if Path(path).is_file():
                raise FileNotFoundError(f"--data {path}: cannot read it ({exc})") from exc
            # a file of the user's folder left out would train on less than asked, silently
            raise FileNotFoundError(f"--data {path}: cannot read {f} ({exc.strerror or exc}): "
                                    f"make it readable or move it out of the folder") from exc
    data = b"\n\n".join(c for c in chunks if c)
    source = "python-stdlib" if path is None else os.fspath(path)
    if len(data) < min_tokens:
        raise ValueError(
            f"--data {source}: {len(data)} bytes of text, too few to train on (need at least "
            f"{min_tokens}); pass a bigger file or folder"
        )
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = _held_out(len(ids), val_fraction)
    return Corpus(train=ids[:-n_val], val=ids[-n_val:], source=source, n_files=len(files))


FINGERPRINT_SLICES, FINGERPRINT_IDS = 8, 4096
""":func:`check_same_data` reads this many slices of this many ids of each part, evenly
spaced from its start to its end."""


def fingerprint(corpus: Corpus) -> list[int]:
    """``[train ids, checksum, validation ids, checksum]``: a checksum is the CRC-32 of a
    part's :data:`FINGERPRINT_SLICES` slices (a few KiB read)."""
    out = []
    for part in (corpus.train, corpus.val):
        n, crc = len(part), 0
        k = min(n, FINGERPRINT_IDS)
        for i in range(FINGERPRINT_SLICES):
            lo = (n - k) * i // (FINGERPRINT_SLICES - 1)
            piece = part[lo:lo + k]
            piece = piece.numpy() if isinstance(piece, torch.Tensor) else np.asarray(piece)
            crc = zlib.crc32(np.ascontiguousarray(piece).tobytes(), crc)
        out += [n, crc]
    return out


def check_same_data(corpus: Corpus, dims: ParallelDims) -> None:
    """Refuse, on every rank, a corpus that is not every rank's (each reads ``--data`` on its
    own machine: another file on one node mismatches the stages' inputs and targets), by its
    :func:`fingerprint`. Collective: one all-reduce of 8 int64 over the world, on the
    device (none in a world of one rank)."""
    if dims.world_size == 1:
        return
    import torch.distributed as dist

    mine = torch.tensor(fingerprint(corpus), dtype=torch.int64)
    # (the largest of each value and of its negation: the largest and the smallest)
    extremes = torch.cat([mine, -mine]).to(dims.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dims.world_group)
    hi, lo = extremes[:4].tolist(), (-extremes[4:]).tolist()
    if hi == lo:
        return
    if hi[0] != lo[0] or hi[2] != lo[2]:
        i, part = (0, "training") if hi[0] != lo[0] else (2, "validation")
        what = f"{lo[i]:,} {part} tokens on some, {hi[i]:,} on others"
    else:
        what = "as many tokens, but other ones"
    raise ValueError(f"--data {corpus.source}: the ranks read different data ({what}): give "
                     f"every machine the same --data")


SCAN_IDS = 1 << 20
"""How many ids of each part :func:`check_vocab` reads (the first)."""


def check_vocab(corpus: Corpus, vocab_size: int, model: str) -> None:
    """Refuse a corpus whose first :data:`SCAN_IDS` training or validation ids reach past
    ``vocab_size``: before any step, the same on every rank (the loader checks each batch
    too, for ids further in)."""
    head = corpus.train[:SCAN_IDS]
    if (isinstance(head, np.ndarray) and head.dtype == np.uint16 and len(head) >= 1024
            and not head[1::2].any() and head[::2].any()):
        raise ValueError(f"--data {corpus.source}: every other uint16 id is 0, as in a file of "
                         f"uint32 ids (their high halves): pass --data-dtype uint32")
    for part in (corpus.train, corpus.val):
        head = part[:SCAN_IDS]
        top = int(head.max()) if len(head) else -1
        if top >= vocab_size:
            raise ValueError(
                f"--data {corpus.source}: token id {top} is beyond the vocabulary of --model "
                f"{model} ({vocab_size} ids): choose a --model whose vocabulary covers the "
                f"data's tokenizer (gpt2-* for GPT-2's), or check --data-dtype")


class BatchLoader:
    """Global batches of ``(inputs, targets)``, each DP rank taking its rows; resumable.

    ``next()`` returns this rank's ``(B/dp, seq_len)`` int64 inputs and targets. Collective:
    none (every rank derives the same order from the seed).
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, *, seq_len: int, global_batch: int,
                 dp: int = 1, dp_rank: int = 0, seed: int = 0, shuffle: bool = True,
                 vocab_size: int | None = None):
        if global_batch % dp:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp={dp}")
        self.tokens = tokens
        self.vocab_size = vocab_size  # the ids are checked against it (when given): tensors
        # here, as a whole (bytes, whose ids cannot reach 256, need no look); memory maps (files
        # larger than memory) in each batch, as numpy arrays (no tensor read in a step)
        if (vocab_size is not None and isinstance(tokens, torch.Tensor) and len(tokens)
                and not (tokens.dtype == torch.uint8 and vocab_size >= 256)
                and int(tokens.max()) >= vocab_size):
            raise ValueError(self._beyond())
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp, self.dp_rank = dp, dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < global_batch:
            raise ValueError(
                f"the data holds {self.n_windows} sequences of {seq_len + 1} tokens, fewer than "
                f"one global batch of {global_batch}: lower --global-batch or --seq-len, or "
                f"pass more --data"
            )
        self.epoch = 0
        self.index = 0  # next window (in this epoch's order) to hand out
        self._order: Permutation | torch.Tensor | None = None  # this epoch's
        # (shuffle.py: no table of every window; a table only for a run saved with one)
        self._table_order = False

    def _windows(self, lo: int, hi: int) -> torch.Tensor:
        """The windows at positions ``[lo, hi)`` of this epoch's order."""
        if not self.shuffle:
            return torch.arange(lo, hi)
        seed = self.seed * 1_000_003 + self.epoch
        if self._order is None and self._table_order:  # a run saved before: its order
            g = torch.Generator().manual_seed(seed)
            self._order = torch.randperm(self.n_windows, generator=g)
        if self._order is None:
            self._order = Permutation(self.n_windows, seed)
        return self._order[lo:hi] if self._table_order else self._order.range(lo, hi)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.global_batch > self.n_windows:  # drop the ragged tail
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        per_rank = self.global_batch // self.dp
        lo = self.index + self.dp_rank * per_rank
        windows = self._windows(lo, lo + per_rank)
        if isinstance(self.tokens, np.ndarray):  # a memory map: only these windows are read
            if self.vocab_size is None:
                ids = self.tokens[self._offsets(windows).numpy()]
            else:
                # every rank reads and checks the whole global batch, so that all of them
                # refuse it at the same step (one rank alone would leave the others in a
                # collective), and takes its rows from it
                whole = self._windows(self.index, self.index + self.global_batch)
                ids = self.tokens[self._offsets(whole).numpy()]
                if ids.max() >= self.vocab_size:
                    raise ValueError(self._beyond())
                ids = ids[lo - self.index:lo - self.index + per_rank]
            seqs = torch.from_numpy(ids.astype(np.int64))
        else:
            seqs = self.tokens[self._offsets(windows)].long()
        self.index += self.global_batch
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def _offsets(self, windows: torch.Tensor) -> torch.Tensor:
        # (b, 1) * seq + (1, seq+1) -> (b, seq+1) token offsets
        return windows[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None, :]

    def _beyond(self) -> str:
        return (f"the data holds token ids beyond the model's vocabulary of {self.vocab_size} "
                f"ids: choose a --model whose vocabulary covers the data's tokenizer (gpt2-* "
                f"for GPT-2's), or check --data-dtype")

    def __iter__(self):
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "global_batch": self.global_batch, "seq_len": self.seq_len,
                "order": "table" if self._table_order else "permutation"}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        for key in ("global_batch", "seq_len"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data loader used {key}={int(state[key])}, this run "
                    f"{getattr(self, key)}: resume with --{key.replace('_', '-')} "
                    f"{int(state[key])}"
                )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed = int(state["seed"])
        # a checkpoint from before the order was recorded shuffled with torch.randperm:
        # the run goes on in that order, so that its epoch hands out each window once
        self._table_order = state.get("order", "table") == "table"
        self._order = None

    def restart(self) -> None:
        """From the data's start (its first epoch's first batch), the seed kept."""
        self.epoch, self.index, self._order, self._table_order = 0, 0, None, False
