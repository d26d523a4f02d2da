"""The model-state lower bound that ``distllm train`` checks before any rank starts."""

from __future__ import annotations

import time

import pytest
import torch

from distllm import ParallelDims
from distllm.cli import main
from distllm.models import GPT, GPTConfig
from distllm.train.footprint import state_bytes_per_rank


def test_the_bound_is_a_plain_adamw_steps_state():
    """float32, one rank: weights, gradients and AdamW's two moments of the built model."""
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, ParallelDims(), dtype=torch.float32, overlap="none")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    assert state_bytes_per_rank(cfg, "float32", tp=1, pp=1, dp=1, zero=0) == held


@pytest.mark.parametrize("zero, per_param", [(0, 16), (1, 4 + 4 + 8 / 4), (2, 4 + 4 / 4 + 8 / 4),
                                             (3, 16 / 4)])
def test_zero_shards_its_parts_over_dp(zero, per_param):
    cfg = GPTConfig.preset("tiny")
    got = state_bytes_per_rank(cfg, "float32", tp=2, pp=1, dp=4, zero=zero)
    assert got == pytest.approx(cfg.num_params() / 2 * per_param, rel=1e-15)
    # bf16: 2-byte weights and gradients, fp32 moments and master weights
    bf16 = state_bytes_per_rank(cfg, "bfloat16", tp=1, pp=1, dp=1, zero=0)
    assert bf16 == cfg.num_params() * (2 + 2 + 8 + 4)


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(capsys):
    t0 = time.perf_counter()
    rc = main(["train", "--model", "tiny", "--n-layers", "100000000", "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--model tiny with 100000000 blocks" in err[0] and "lower --n-layers" in err[0]
    assert time.perf_counter() - t0 < 60  # not after building the blocks


def test_a_gpu_rank_reads_its_own_gpus_memory(monkeypatch):
    """Each rank of a node reads the memory of its own GPU (LOCAL_RANK), not GPU 0's."""
    import types

    from distllm.train.footprint import check_fits, memory_per_rank

    read = []

    def props(i):
        read.append(i)
        return types.SimpleNamespace(total_memory=80 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert memory_per_rank(ranks_here=8) == (80 * 2**30, "a GPU") and read == [2]
    # 16 bytes per parameter in fp32: gpt2-xl (1.6B) fits in 80 GiB, five times its depth not
    cfg = GPTConfig.preset("gpt2-xl")
    check_fits(cfg, "float32", model="gpt2-xl", tp=1, pp=1, dp=8, zero=0, ranks_here=8)
    with pytest.raises(ValueError, match=r"more than the 80\.0 GiB of a GPU: lower --n-layers"):
        check_fits(GPTConfig.preset("gpt2-xl", n_layers=240), "float32", model="gpt2-xl",
                   tp=1, pp=1, dp=8, zero=0, ranks_here=8)


def test_zero3_needs_its_shard_only(monkeypatch):
    """ZeRO-3 holds 1/dp of the state, and never the stage whole (each layer is materialised
    and sharded in turn): gpt2-xl at 1600 blocks (49B parameters, 92 GiB of bf16 weights)
    over dp64 needs 11.5 GiB a rank and starts on an 80 GiB GPU; over dp4, 183 GiB does not."""
    import types

    from distllm.train.footprint import check_fits, state_bytes_per_rank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    cfg = GPTConfig.preset("gpt2-xl", n_layers=1600)
    # 2 + 2 + 12 bytes a parameter (bf16 weights and gradients, fp32 masters and moments)
    assert state_bytes_per_rank(cfg, "bfloat16", tp=1, pp=1, dp=64, zero=3) == pytest.approx(
        cfg.num_params() * 16 / 64, rel=1e-12)
    check_fits(cfg, "bfloat16", model="gpt2-xl", tp=1, pp=1, dp=64, zero=3, ranks_here=8)
    with pytest.raises(ValueError, match=r"needs at least 18\d\.\d GiB per rank for its "
                                         r"bfloat16 weights, gradients and AdamW states at "
                                         r"tp1\.pp1\.dp4\.zero3, more than the 80\.0 GiB"):
        check_fits(cfg, "bfloat16", model="gpt2-xl", tp=1, pp=1, dp=4, zero=3, ranks_here=8)
