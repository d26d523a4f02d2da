"""Every rank trains on the same corpus: each reads ``--data`` on its own machine, and a
rank whose file differs (another length, or other contents) is refused on every rank
before the first step, naming --data (it trained on inputs and targets that did not match
across the pipeline's stages)."""

from __future__ import annotations

from distllm.testing import run_distributed


def _train_each(variants: list[str], data: str, out: str) -> list[int | str]:
    """Rank function: a 1-step run of tp1.pp2 for each variant of rank 1's corpus (``same``,
    ``contents``: one byte other, ``length``: 40 bytes fewer); the steps it ran, or its
    error."""
    import torch.distributed as dist

    from distllm.train import trainer
    from tests.train._util import make_cfg

    real = trainer.load_corpus
    done: list[int | str] = []
    for i, variant in enumerate(variants):

        def other(*args, variant=variant, **kwargs):
            corpus = real(*args, **kwargs)
            if dist.get_rank() == 1 and variant == "contents":  # another copy of the file
                corpus.train = corpus.train.clone()
                corpus.train[0] ^= 1
            elif dist.get_rank() == 1 and variant == "length":
                corpus.train = corpus.train[:-40]
            return corpus

        trainer.load_corpus = other
        try:
            done.append(len(trainer.train(make_cfg(data, f"{out}/run{i}", pp=2, m=2,
                                                   steps=1)).losses))
        except ValueError as exc:
            done.append(str(exc))
        finally:
            trainer.load_corpus = real
    return done


def test_ranks_with_other_data_are_refused_naming_data(corpus, tmp_path):
    from distllm.train.data import load_corpus

    n = len(load_corpus(corpus).train)
    got = run_distributed(_train_each, 2, ["same", "contents", "length", "same"], corpus,
                          str(tmp_path), timeout=300)
    says = (f"--data {corpus}: the ranks read different data ({{}}): give every machine the "
            f"same --data")
    want = [1, says.format("as many tokens, but other ones"),
            says.format(f"{n - 40:,} training tokens on some, {n:,} on others"), 1]
    assert got == [want, want], got
