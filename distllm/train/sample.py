"""``distllm sample``: text from a training checkpoint, a look at what a run has learnt.

The checkpoint (the newest of a run, or ``--step N``) is read in one process, whatever
layout saved it, into a Hugging Face GPT-2 model as ``distllm export`` writes it, whose
``generate`` samples: its KV cache, temperature and top-k (``--temperature 0``: greedy). A
run on text reads and writes bytes (:class:`~distllm.train.data.ByteTokenizer`); a run on a
tokenizer's ids (``.bin`` data) needs that tokenizer, ``--tokenizer DIR``, and a sample ends
at its end-of-text token, where ``distllm tokenize`` ended each file. The prompt and the new
tokens must fit the model's context; by default a sample ends where the positions the run
trained end (its ``--seq-len``, or every position of ``--init-from`` weights).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator

import torch

__all__ = ["add_arguments", "run", "sample", "iter_samples"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN",
                   help="a training run's --out folder (its newest complete checkpoint), or "
                        "one checkpoint folder (RUN/checkpoints/step_00000300 for step 300)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint of this step of RUN (default: the newest)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate after the prompt (default: 200, or what the "
                        "positions the run trained (its --seq-len) leave after the prompt "
                        "where that is fewer)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature, 0 or at least 1e-4; 0 picks the likeliest token "
                        "(default 0.8)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k likeliest tokens; 0: all (default 50)")
    p.add_argument("--num-samples", type=int, default=1,
                   help=f"samples to draw, {SAMPLE_BATCH} at a time, each batch printed as it "
                        f"ends (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default 0)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the Hugging Face tokenizer of a run on token ids (.bin data); a run "
                        "on text needs none; 'bytes': read and write bytes")


def _codec(tokens: str | None, vocab: int, tokenizer: str | None):
    """``(encode, decode, eos, n_ids)`` of the run's tokens (``"bytes"``, ``"ids"``, or None
    from a checkpoint that did not record them: bytes for a vocabulary of 256 ids at most):
    bytes, or the tokenizer in the folder ``tokenizer`` (``"bytes"``: bytes, whatever was
    recorded). ``eos``: the tokenizer's end-of-text id, which ends a sample (None for
    bytes). ``n_ids``: the ids a sample may take are those below it (256 for bytes, whatever
    the model's vocabulary; None: all of the model's)."""
    from distllm.train.data import ByteTokenizer
    from distllm.train.tokenize_data import BYTE_VOCAB, load_tokenizer

    if tokens is None:
        tokens = "bytes" if vocab <= BYTE_VOCAB else "ids"
    if tokenizer is None and tokens == "ids":
        raise ValueError(f"the run trained on a tokenizer's ids ({vocab:,}-token vocabulary): "
                         f"pass its tokenizer with --tokenizer DIR (or --tokenizer bytes)")
    if tokenizer is not None and tokenizer != "bytes" and tokens == "bytes":
        raise ValueError(f"--tokenizer {tokenizer}: the run trained on text, as bytes; drop "
                         f"--tokenizer")
    if tokenizer is None or tokenizer == "bytes":
        byte = ByteTokenizer()
        return (lambda text: byte.encode(text).tolist()), byte.decode, None, BYTE_VOCAB
    tok = load_tokenizer(tokenizer)
    if len(tok) > vocab:
        raise ValueError(f"--tokenizer {tokenizer}: its {len(tok):,} ids do not fit the "
                         f"model's {vocab:,}-token vocabulary; pass the run's tokenizer")
    return ((lambda text: tok(text, add_special_tokens=False)["input_ids"]), tok.decode,
            tok.eos_token_id, None)


def _until_eos(row: list[int], start: int, eos: int | None) -> list[int]:
    """``row`` up to its first ``eos`` at or after ``start`` (kept): ``generate`` pads a
    sample that ended early with more of them."""
    if eos is not None and eos in row[start:]:
        return row[:row.index(eos, start) + 1]
    return row


DEFAULT_NEW_TOKENS = 200

MIN_TEMPERATURE = 1e-4
"""The lowest ``--temperature`` but 0 (greedy). At 1e-4 a token whose logit is 0.01 below
the likeliest one is drawn e**-100 times as often: sampling is already greedy but for near
ties, so a lower one gains nothing, and far lower the float32 logits divided by it overflow
(1e-50 is 0 in float32: generate failed on a NaN probability)."""


def sample(ckpt, prompt: str = "\n", *, max_new_tokens: int | None = None,
           temperature: float = 0.8, top_k: int = 50, num_samples: int = 1, seed: int = 0,
           tokenizer: str | None = None) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the prompt's text, then the new text) by
    the model of the checkpoint folder ``ckpt``; ``max_new_tokens`` None: 200, or what the
    model's context leaves after the prompt."""
    return list(iter_samples(ckpt, prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, num_samples=num_samples,
                             seed=seed, tokenizer=tokenizer))


SAMPLE_BATCH = 32
"""Continuations generated together: ``num_samples`` beyond it are generated in turn, so that
memory does not grow with it (the first 32 of more are those of ``num_samples`` 32)."""


def iter_samples(ckpt, prompt: str = "\n", *, max_new_tokens: int | None = None,
                 temperature: float = 0.8, top_k: int = 50, num_samples: int = 1,
                 seed: int = 0, tokenizer: str | None = None) -> Iterator[str]:
    """:func:`sample`'s continuations one at a time, as each batch of at most
    :data:`SAMPLE_BATCH` is generated; its arguments are checked before the first."""
    check = _prepare(ckpt, prompt, max_new_tokens, temperature, top_k, num_samples, seed,
                     tokenizer)
    return _generate(*check, temperature=temperature, top_k=top_k, num_samples=num_samples,
                     seed=seed)


def _prepare(ckpt, prompt, max_new_tokens, temperature, top_k, num_samples, seed, tokenizer):
    from pathlib import Path

    from distllm.models.hf import hf_from_layers
    from distllm.train.checkpoint import read_layers, trained_positions_of
    from distllm.train.config import MAX_SEED

    for knob, value, least in (("--max-new-tokens", max_new_tokens, 1),
                               ("--num-samples", num_samples, 1), ("--top-k", top_k, 0)):
        if value is not None and value < least:
            raise ValueError(f"{knob} {value}: it must be at least {least}")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"--seed {seed}: choose a seed in [0, 2**32)")
    if not 0 <= temperature < math.inf:  # (nan too; inf samples uniformly: noise)
        raise ValueError(f"--temperature {temperature}: it must be 0 (greedy) or a finite "
                         f"positive number (0.8 is the default)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"--temperature {temperature}: below {MIN_TEMPERATURE:g} sampling is "
                         f"greedy in effect (near 0 the logits divided by it overflow); pass "
                         f"0 (greedy), or at least {MIN_TEMPERATURE:g}")
    cfg, layers, tokens = read_layers(Path(ckpt))
    trained = trained_positions_of(Path(ckpt), cfg.max_seq_len)
    encode, decode, eos, n_ids = _codec(tokens, cfg.vocab_size, tokenizer)
    try:
        ids = encode(prompt)
    except UnicodeError as exc:  # (a byte of the command line that is not UTF-8)
        raise ValueError(f"--prompt: it is not text that encodes as UTF-8 ({exc.reason} at "
                         f"character {exc.start}); give UTF-8 text") from None
    if not ids:
        raise ValueError("--prompt is empty: give the model some text to continue")
    if len(ids) >= cfg.max_seq_len:
        raise ValueError(f"--prompt: its {len(ids)} tokens fill the model's context of "
                         f"{cfg.max_seq_len}; shorten it")
    if max_new_tokens is None:  # within the trained positions where the prompt leaves room
        room = trained if len(ids) < trained else cfg.max_seq_len
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room - len(ids))
    if len(ids) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: with the prompt's {len(ids)} "
                         f"tokens it passes the model's context of {cfg.max_seq_len}; lower "
                         f"it, or shorten --prompt")
    if len(ids) + max_new_tokens > trained:
        print(f"note: the run trained the first {trained} of the model's {cfg.max_seq_len} "
              f"positions (its --seq-len); the tokens past them are at positions it never "
              f"learnt", file=sys.stderr)
    with torch.random.fork_rng(devices=[]):  # (its initialisation, overwritten, draws)
        hf = hf_from_layers(cfg, layers)
    return hf, ids, max_new_tokens, decode, eos, n_ids


def _generate(hf, ids, max_new_tokens, decode, eos, n_ids=None, *, temperature, top_k,
              num_samples, seed) -> Iterator[str]:
    """The samples, ``n_ids`` (None: every id) bounding the ids generated: a run on bytes
    in a vocabulary past 256 ids never trained the others, which are no bytes to write."""
    from distllm.models.hf import quiet_transformers
    from distllm.train.checkpoint import rng_state, set_rng_state

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf.to(device)
    greedy = temperature == 0
    vocab = hf.config.vocab_size
    # (the ids at n_ids and past it at -inf before temperature and top-k, greedy or not)
    bound = ({"suppress_tokens": list(range(n_ids, vocab))}
             if n_ids is not None and n_ids < vocab else {})
    # the sampling's own random stream, from the seed, kept between batches: the caller's
    # random state is neither used (between the batches it yields) nor changed
    gpus = [torch.cuda.current_device()] if device.type == "cuda" else []
    drawing = torch.device("cuda", gpus[0]) if gpus else device  # the generator it draws from
    state = None
    for first in range(0, num_samples, SAMPLE_BATCH):
        n = min(SAMPLE_BATCH, num_samples - first)
        with torch.random.fork_rng(devices=gpus), torch.no_grad(), quiet_transformers():
            if state is None:  # (torch.manual_seed would seed every GPU)
                torch.default_generator.manual_seed(seed)
                if gpus:
                    torch.cuda.manual_seed(seed)
            else:
                set_rng_state(state, drawing)
            out = hf.generate(
                torch.tensor([ids] * n, device=device),
                attention_mask=torch.ones(n, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens, do_sample=not greedy,
                **({} if greedy else {"temperature": temperature, "top_k": top_k or None}),
                eos_token_id=eos, pad_token_id=0 if eos is None else eos, **bound)
            state = rng_state(drawing)
        for row in out.cpu().tolist():
            yield decode(_until_eos(row, len(ids), eos))


def run(args: argparse.Namespace) -> int:
    from distllm.train.export import checkpoint_of, needs_transformers

    needs_transformers("sample")

    ckpt = checkpoint_of(args.run, args.step)
    texts = iter_samples(ckpt, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k,
                         num_samples=args.num_samples, seed=args.seed, tokenizer=args.tokenizer)
    for i, text in enumerate(texts):
        if i:
            print("\n---")
        print(text, flush=True)
    return 0
