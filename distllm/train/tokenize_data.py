"""``distllm tokenize``: text as token ids for ``--data``, through a Hugging Face tokenizer.

distllm reads text as bytes (:class:`~distllm.train.data.ByteTokenizer`). A model that knows
a tokenizer's ids (GPT-2's, for ``--init-from``) must train on those ids: this command
writes them the way ``--data`` reads them, a folder holding ``train.bin`` and ``val.bin``
(nanoGPT's layout: the ids back to back, little-endian, ``uint16``, or ``uint32`` for a
vocabulary past 65,536, which ``--data-dtype`` then names).

SRC is a text file or a folder of them (the files ``--data`` reads there, in the same
order). Each file is one document, followed by the tokenizer's end-of-text token when it
has one (GPT-2's ``<|endoftext|>``), as nanoGPT's OpenWebText preparation does; no other
special token is added. The last ``--val-fraction`` of the ids (at least min(n/2, 4096), as
for text) is ``val.bin``.

With GPT-2's tokenizer (a byte-level pre-tokenizer without a prefix space:
:func:`cuts_are_exact`) a file is read and tokenized in pieces of at least ``chunk_chars``
characters, each cut at the first place past that length where a space, tab, carriage
return or newline is followed by a non-space character: before that last white-space
character. The pre-tokenizer splits there in any case (its white-space pre-token stops one
character short of the next word, which takes that character or stands after it), so the
ids are those of the whole file (tested on random text cut every few characters). Only a
file without such a place (no white space past the first ``chunk_chars`` characters) is
one piece, held in memory; so is every file under another tokenizer, or under GPT-2's with
added tokens that are not special (matched before the pre-tokenizer), where a cut could
change the ids. The ids stream to disk, so a file or a corpus larger than memory is
tokenized. A ``<|endoftext|>`` written in the
text is tokenized as text (as tiktoken's ``encode_ordinary`` does), not as a document's end.
The folder is written beside DEST and renamed into place once complete: a failed run leaves
nothing (a write that fails, a full disk, is one line naming DEST), and an existing DEST is
refused unless it is an empty folder.
"""

from __future__ import annotations

import argparse
import codecs
import itertools
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["add_arguments", "run", "tokenize_to_bins", "tokenizer_files", "load_tokenizer",
           "check_pretrained_tokens", "BYTE_VOCAB"]

CHUNK_CHARS = 1 << 20
"""The least length of a piece of text tokenized at once, in characters."""

BATCH_PIECES = 16
"""Pieces tokenized together: a Hugging Face fast tokenizer encodes a batch on every core."""

# before the last white space of a run that a word follows ("x  |" + " y"): GPT-2's regex
# ends a white-space pre-token there (\s+(?!\S)) and starts the next one there (" ?\p{L}+"
# or "\s+"). Python's \S is no wider than the tokenizer's (its \s takes every Unicode
# White_Space and \x1c-\x1f), so a cut here is one there.
_CUT = re.compile(r"(?=[\t\n\r ]\S)")

BYTE_VOCAB = 256
"""A model with at most this many ids reads bytes (distllm's text, ``ByteTokenizer``)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds a Hugging Face tokenizer's files."""
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def check_pretrained_tokens(path: str, vocab_size: int, data: str | None) -> None:
    """ValueError when the text ``--data data`` (None: the default corpus), which distllm
    reads as bytes, would train the pretrained model of the folder ``path`` (``vocab_size``
    ids), which reads a tokenizer's ids: the run would fine-tune it on ids that mean other
    things to it. A model reads bytes when ``distllm export`` wrote it from a run on text
    (``distllm_tokens`` in its config: ``"bytes"``), or, where its config does not say,
    when its vocabulary is :data:`BYTE_VOCAB` ids at most.
    The error names ``distllm tokenize``, with the folder as the tokenizer where it holds one."""
    from distllm.train.data import tokens_of

    if tokens_of(data) != "bytes":
        return
    with open(Path(path) / "config.json") as f:
        said = json.load(f).get("distllm_tokens")  # what distllm export recorded
    if said == "bytes" or said is None and vocab_size <= BYTE_VOCAB:
        return
    src = data if data is not None else "SRC"
    what = (f"--data {data} is text" if data is not None
            else "without --data the run trains on text (the standard library's sources)")
    tok = path if tokenizer_files(path) else "TOKENIZER"
    where = "" if tok == path else (" (TOKENIZER: a folder holding the model's tokenizer, "
                                    "as its save_pretrained writes it)")
    raise ValueError(f"--init-from {path}: its model reads a tokenizer's ids (a "
                     f"{vocab_size:,}-token vocabulary), and {what}, which distllm reads as "
                     f"bytes: write the text's ids with `distllm tokenize {src} OUT "
                     f"--tokenizer {tok}`{where} and pass --data OUT")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="a text file, or a folder of text files")
    p.add_argument("dest", metavar="DEST",
                   help="a new folder for train.bin and val.bin (pass it to train's --data)")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a folder holding a Hugging Face tokenizer (what its save_pretrained "
                        "writes; nothing is downloaded), e.g. the --init-from folder")
    p.add_argument("--val-fraction", type=float, default=0.02,
                   help="the share of the ids, at the end, held out as val.bin (default 0.02)")


def load_tokenizer(path: str):
    """The Hugging Face tokenizer in the folder ``path`` (ValueError naming ``--tokenizer``)."""
    from distllm.models.hf import quiet_transformers

    if not Path(path).is_dir() or not tokenizer_files(path):
        raise ValueError(f"--tokenizer {path}: no tokenizer there (none of "
                         f"{', '.join(_TOKENIZER_FILES)}); pass a folder a Hugging Face "
                         f"tokenizer's save_pretrained wrote")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"--tokenizer {path}: reading a Hugging Face tokenizer needs the "
                         f"transformers package (pip install transformers)") from None
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {path}: {' '.join(str(exc).split())}") from None


def cuts_are_exact(tok) -> bool:
    """Whether text cut at :data:`_CUT` tokenizes to the whole text's ids under ``tok``:
    GPT-2's pre-tokenizer (byte-level, its regex, no prefix space, no normalizer), which
    splits there anyway, and no added token but special ones. Another one (a
    SentencePiece-style ``Metaspace``, a prefix space) would begin each piece as a new text;
    an added token that is not special (runs of spaces, as CodeGen's) is matched before the
    pre-tokenizer, across a cut."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    # an added token that is not special is matched in the raw text before the pre-tokenizer
    # runs (split_special_tokens hands only the special ones to it): a cut can split its
    # match, or the white space before it ("x  " then the token: "  " in the whole text,
    # " " and " " when cut between the spaces)
    added = any(not t.get("special", False) for t in spec.get("added_tokens") or [])
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space") and pre.get("use_regex", True) and not added)


def _pieces(f: Path, chunk_chars: int, cut: bool = True) -> Iterator[str]:
    """The text of ``f`` in pieces of at least ``chunk_chars`` characters (the last may be
    shorter), cut only where :data:`_CUT` matches; ``cut`` False: the whole text."""
    dec = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    with open(f, "rb") as fh:
        while True:
            block = fh.read(chunk_chars)
            # no cut before here (and none at the end of a buffer: a cut needs the next two
            # characters, so the last one is tried again)
            seen = max(len(buf) - 1, 0)
            buf += dec.decode(block, final=not block)
            while cut and len(buf) > chunk_chars and (
                    m := _CUT.search(buf, max(chunk_chars, seen))):
                yield buf[:m.start()]
                buf, seen = buf[m.start():], 0
            if not block:
                break
    if buf:
        yield buf


def _text_pieces(src: str, files: list[Path], chunk_chars: int, cut: bool
                 ) -> Iterator[tuple[str, bool]]:
    """``(piece, ends its file)`` over ``files``, each file's pieces then ``("", True)``."""
    for f in files:
        try:
            for piece in _pieces(f, chunk_chars, cut):
                yield piece, False
        except UnicodeDecodeError as exc:
            raise ValueError(f"SRC {src}: {f} is not UTF-8 text ({exc.reason}); convert it, "
                             f"or leave it out") from None
        except OSError as exc:  # (a ValueError: an OSError here is DEST's, a failed write)
            raise ValueError(f"SRC {src}: cannot read {f} ({exc})") from None
        yield "", True


def tokenize_to_bins(src: str, dest: str, tokenizer: str, val_fraction: float = 0.02,
                     chunk_chars: int = CHUNK_CHARS, batch: int = BATCH_PIECES) -> dict:
    """Write ``dest/train.bin`` and ``dest/val.bin``: the ids of the text ``src`` under the
    Hugging Face tokenizer in the folder ``tokenizer`` (see the module's docstring), the
    pieces tokenized ``batch`` at a time. Returns what was written: ``train`` and ``val`` id
    counts, ``dtype``, ``vocab``, ``files``."""
    from distllm.train.data import MIN_TOKENS, _files_of, _held_out
    from distllm.train.new_folder import new_folder, write_failed

    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction}: choose a share between 0 and 1")
    files = _files_of(src, knob="SRC")
    tok = load_tokenizer(tokenizer)
    vocab = len(tok)
    dtype = np.dtype("<u2" if vocab <= 1 << 16 else "<u4")
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    pieces = _text_pieces(src, files, chunk_chars, cuts_are_exact(tok))
    try:
        with new_folder(dest) as tmp:
            n = _write_ids(tmp / "train.bin", pieces, tok, eos, dtype, batch)
            if n < 2:
                raise ValueError(f"SRC {src}: {n} token ids, too few to split into train.bin "
                                 f"and val.bin; pass more text")
            n_val = _held_out(n, val_fraction)
            if n - n_val < MIN_TOKENS:  # what train would refuse: say so before writing it
                raise ValueError(f"SRC {src}: {n} token ids leave {n - n_val} for train.bin, "
                                 f"fewer than the {MIN_TOKENS} distllm train needs; pass more "
                                 f"text")
            with open(tmp / "train.bin", "r+b") as train, open(tmp / "val.bin", "wb") as val:
                train.seek((n - n_val) * dtype.itemsize)
                shutil.copyfileobj(train, val)
                train.truncate((n - n_val) * dtype.itemsize)
                for fh in (train, val):
                    fh.flush()
                    os.fsync(fh.fileno())
    except OSError as exc:  # (SRC's are ValueErrors): a full disk, a failing device
        raise write_failed(dest, exc) from None
    return {"train": n - n_val, "val": n_val, "dtype": dtype.name, "vocab": vocab,
            "files": len(files)}


def _write_ids(path: Path, pieces: Iterator[tuple[str, bool]], tok, eos: list[int],
               dtype: np.dtype, batch: int) -> int:
    """Write the ids of ``pieces`` (:func:`_text_pieces`) under ``tok`` to the new file
    ``path``, ``eos`` after each file's, ``batch`` pieces tokenized together; returns how
    many ids it wrote."""
    from distllm.models.hf import quiet_transformers

    n = 0
    with open(path, "wb") as out:
        while pending := list(itertools.islice(pieces, batch)):
            # the text's own "<|endoftext|>" is text, not a document's end (as tiktoken's
            # encode_ordinary); quiet: "longer than the model's maximum length"
            with quiet_transformers():
                encoded = tok([p for p, _ in pending], add_special_tokens=False,
                              split_special_tokens=True)
            for ids, (_, ends) in zip(encoded["input_ids"], pending, strict=True):
                ids = ids + eos if ends else ids
                out.write(np.asarray(ids, dtype=dtype).tobytes())
                n += len(ids)
    return n


def run(args: argparse.Namespace) -> int:
    got = tokenize_to_bins(args.src, args.dest, args.tokenizer, args.val_fraction)
    flag = "" if got["dtype"] == "uint16" else f" --data-dtype {got['dtype']}"
    print(f"distllm tokenize: {args.dest}: train.bin {got['train']:,} ids, val.bin "
          f"{got['val']:,} ({got['dtype']}, a {got['vocab']:,}-token vocabulary, "
          f"{got['files']} file{'s' if got['files'] != 1 else ''}); train with "
          f"--data {args.dest}{flag}")
    return 0
