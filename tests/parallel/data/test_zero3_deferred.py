"""ZeRO-3 with a model built on the meta device (``param_init_fn``): each unit is
materialised, initialised and sharded before the next one exists, it holds the values the
model built whole would hold (GPT's seeded init, a tied embedding in the root unit), and it
trains as that model does (2 gloo ranks, float64; the engine's runs against a single-process
reference are in tests/train/test_engine_dp.py). Misuse is one ValueError naming the knob."""

from __future__ import annotations

import pytest
import torch

from distllm.testing import run_distributed
from tests.parallel.data._common import adamw, groups_of

SEED = 3


def _cfg(tie: bool):
    from distllm.models.config import GPTConfig

    return GPTConfig(vocab_size=250, n_layers=2, hidden_size=32, n_heads=4, ffn_hidden_size=48,
                     max_seq_len=16, tie_embeddings=tie)


def _zero3(model, dims, **kw):
    from distllm.parallel.data.zero import ZeroOptimizer

    return ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims,
                         param_groups=groups_of(model), units=model.layer_list(), **adamw(),
                         **kw)


def _live(model) -> int:
    """Elements of ``model``'s parameters that hold memory now."""
    return sum(p.numel() for p in model.parameters()
               if not p.is_meta and p.untyped_storage().nbytes() > 0)


def _train(model, opt, dims, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        x = torch.randint(0, 250, (4, 16), generator=g)
        y = torch.randint(0, 250, (4, 16), generator=g)
        lo = dims.dp_rank * 2
        model.loss(model(x[lo: lo + 2]), y[lo: lo + 2]).backward()
        opt.step()
        opt.zero_grad()


def _deferred_rank(tie: bool):
    from distllm import ParallelDims
    from distllm.models.gpt import GPT
    from distllm.models.sharding import init_params
    from distllm.train.engine import move_buffers

    dims = ParallelDims(tp=1, pp=1, dp=2)
    cfg = _cfg(tie)
    whole = GPT(cfg, dims, seed=SEED, dtype=torch.float64)
    expect = {k: v.clone() for k, v in whole.state_dict().items()}
    with torch.device("meta"):
        model = GPT(cfg, dims, seed=None, dtype=torch.float64)
    move_buffers(model, dims.device)
    calls = []

    def init(unit, params):
        # the parameters holding memory while a unit is initialised: its own only
        calls.append((_live(model), sum(p.numel() for p in params), unit is model))
        init_params(model, params, SEED)

    opt = _zero3(model, dims, param_init_fn=init)
    got = model.state_dict()  # (gathered by ZeRO's state-dict hooks)
    init_err = max((got[k] - expect[k]).abs().max().item() for k in expect)
    same_keys = sorted(got) == sorted(expect)
    after = _live(model)
    _train(model, opt, dims)
    _train(whole, _zero3(whole, dims), dims)
    trained = model.state_dict()
    ref = whole.state_dict()
    train_err = max((trained[k] - ref[k]).abs().max().item() for k in ref)
    return calls, init_err, same_keys, after, train_err


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_meta_model_is_materialised_a_unit_at_a_time(tie):
    calls, init_err, same_keys, after, train_err = run_distributed(
        _deferred_rank, 2, tie, timeout=300)[1]
    units = 2 + 2  # the embedding, 2 blocks, the head
    assert len(calls) == units + tie  # the tied embedding matrix: the root unit, last
    assert [root for *_, root in calls] == [False] * units + [True] * tie
    # when a unit is initialised, the only parameters holding memory are its own
    assert all(live == mine > 0 for live, mine, _ in calls), calls
    assert after == 0  # sharded: every parameter reads as empty
    assert same_keys and init_err == 0.0  # GPT(seed=3)'s values, bit for bit
    assert train_err <= 1e-12  # and it trains as the model built whole does


def _refusals_rank(case: str):
    from torch import nn

    from distllm import ParallelDims
    from distllm.parallel.data.zero import ZeroOptimizer

    dims = ParallelDims(tp=1, pp=1, dp=2)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fn = (lambda unit, params: None)
    kw = dict(stage=3, dims=dims, lr=1e-3)
    if case == "stage2":
        kw.update(stage=2, param_init_fn=fn)
    elif case == "meta-stage1":
        kw.update(stage=1)
    elif case == "no-init":
        pass
    elif case == "meta-buffer":
        with torch.device("meta"):
            model.register_buffer("mask", torch.ones(2))
        kw.update(param_init_fn=fn)
    elif case == "frozen":
        model[1].bias.requires_grad_(False)
        kw.update(param_init_fn=fn)
    try:
        ZeroOptimizer(model, torch.optim.AdamW, **kw)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("case,needle", [
    ("stage2", "param_init_fn is read at stage 3 only"),
    ("meta-stage1", "stages 0-2 need the model built on a real device"),
    ("no-init", "materialises them one unit at a time with param_init_fn"),
    ("meta-buffer", "buffers ['mask'] are on the meta device"),
    ("frozen", "parameters ['1.bias'] are on the meta device but not optimised"),
])
def test_meta_parameters_it_cannot_materialise_are_refused(case, needle):
    msgs = run_distributed(_refusals_rank, 2, case, timeout=120)
    assert all(needle in m for m in msgs), msgs


def _failing_init_rank():
    from torch import nn

    from distllm import ParallelDims
    from distllm.parallel.data.zero import ZeroOptimizer

    dims = ParallelDims(tp=1, pp=1, dp=2)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    calls, seen = [], []

    def init(unit, params):
        calls.append(unit)
        if len(calls) == 2:  # the first unit, already packed, reads as empty here
            seen.extend([model[0].weight.numel(), float(model[0].weight.sum())])
            raise RuntimeError("the second unit's init failed")
        for p in params:
            p.fill_(1.0)

    try:
        ZeroOptimizer(model, torch.optim.AdamW, stage=3, dims=dims, param_init_fn=init, lr=1e-3)
    except RuntimeError as e:
        msg = str(e)
    w = model[0].weight  # the unit packed before the failure: readable, and empty
    out = [msg, *seen, w.numel(), float(w.sum()), model[2].weight.is_meta]
    # a model on a real device whose wrap fails after its units were packed (the gradient
    # buckets refuse the argument)
    real = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    try:
        ZeroOptimizer(real, torch.optim.AdamW, stage=3, dims=dims, lr=1e-3,
                      reduce_scatter_impl="nonesuch")
    except ValueError as e:
        out.append("reduce_scatter_impl='nonesuch'" in str(e))
    return out + [float(real[0].weight.sum())]


def test_a_failed_init_leaves_no_parameter_on_freed_memory():
    """The units packed so far read as empty tensors while a later unit is initialised and
    after a ``param_init_fn`` that raises (its error ends the construction), not as views of
    their freed buffers, whose reads crashed the process with a segmentation fault; the units
    after it are still meta. So does a real model whose wrap fails later, in the gradient
    buckets."""
    got = run_distributed(_failing_init_rank, 2, timeout=120)
    assert got == [["the second unit's init failed", 0, 0.0, 0, 0.0, True, True, 0.0]] * 2
