"""The engine's pipeline stages run their chunk's ``GPT.forward``: batch-split overlap (TP
without sequence parallelism) splits each micro-batch inside a stage, in training and in
evaluation, as it does without a pipeline. The losses are checked against one process in
``test_parity.py`` (``tp2.pp2...bs2``)."""

from __future__ import annotations

from distllm.testing import run_distributed
from tests.train._util import make_cfg


def _split_rank(data: str, out: str) -> dict:
    import torch

    from distllm import ParallelDims
    from distllm.models import gpt
    from distllm.train.engine import Engine

    cfg = make_cfg(data, out, tp=2, pp=2, m=2, bs=2, overlap="chunked")
    dims = ParallelDims(tp=2, pp=2)
    eng = Engine(cfg, cfg.model_config(), dims)
    calls: list[tuple[int, int]] = []  # (branches, rows) of each split run of blocks
    real = gpt.split_residual

    def spy(branches, x, parts):
        calls.append((len(branches), x.shape[0], parts))
        return real(branches, x, parts)

    gpt.split_residual = spy
    try:
        x = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
        eng.update(1.0, eng.forward_backward(x, x))
        trained = list(calls)
        calls.clear()
        eng.eval_loss(x, x)
    finally:
        gpt.split_residual = real
    return {"pp_rank": dims.pp_rank, "train": trained, "eval": calls}


def test_a_pipeline_stage_splits_its_micro_batches(corpus, tmp_path):
    for r in run_distributed(_split_rank, 4, corpus, str(tmp_path), timeout=300):
        # each stage holds two of tiny's four blocks (and the embedding or the head): their
        # attention and MLP branches, on each micro-batch of 4 rows, in 2 parts
        assert r["train"] == [(4, 4, 2)] * 2, r
        assert r["eval"] and all(parts == 2 for _, _, parts in r["eval"]), r
