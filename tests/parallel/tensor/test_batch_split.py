"""Batch-split overlap (``distllm.parallel.tensor.batch_split``, ``GPT(batch_split=...)``) on
2 gloo ranks at tp2, in float64: the loss against the single-process model built from the same
weights (replicated biases and norms perturbed, so a bias added twice or never shows), every
gradient against the unsplit run, which parts ran deferred, what ``"auto"`` does with and
without autograd, blocks that must run whole, and the guards. One spawn, each scenario its own
test; the trainer's parity matrix runs ``batch_split=2`` with the default optimizer settings
(``tests/train/test_parity.py``)."""

from __future__ import annotations

import pytest
import torch

from distllm.models.config import GPTConfig
from distllm.models.gpt import GPT, check_batch_split
from distllm.train.config import ParallelConfig
from tests._errors import worst
from tests._spawn import SpawnCache, case_of, run_cases

DT = torch.float64
TOL = 1e-12
CFG = GPTConfig(n_layers=2, hidden_size=16, n_heads=2, ffn_hidden_size=32, max_seq_len=16)


def _model(dims, split, overlap="chunked") -> GPT:
    """The GPT of ``CFG`` at ``dims`` with its replicated parameters (biases of the
    row-parallel layers, norms) moved off their initial zeros and ones, the same on every
    rank and at every layout (seeded by name)."""
    m = GPT(CFG, dims, dtype=DT, batch_split=split, overlap=overlap)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o.bias", "fc2.bias")) or ".ln_" in name:
                g = torch.Generator().manual_seed(sum(map(ord, name)))
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=DT))
    return m


def _tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(3))


def _forward_modes(m: GPT) -> set[str]:
    return {mod.plan.stats.forward.mode for n, mod in m.named_modules()
            if n.endswith(("attn.o", "mlp.fc2"))}


def _train(dims, split, batch: int = 5) -> dict:
    m = _model(dims, split)
    x = _tokens(batch)
    loss = m.loss(m(x), x)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
            "modes": _forward_modes(m)}


def _parity(dims) -> dict:
    """tp2 with 1, 2 and 3 parts (5 sequences: uneven parts) against the tp1 model."""
    from distllm import ParallelDims

    one = ParallelDims(tp=1)  # dp=2: each rank holds the whole model, no collective
    ref = _model(one, 1)
    x = _tokens(5)
    want = ref.loss(ref(x), x).item()
    runs = {s: _train(dims, s) for s in (1, 2, 3)}
    base = runs[1]["grads"]
    return {"want": want, "loss": {s: r["loss"] for s, r in runs.items()},
            "grad_err": {s: worst((r["grads"][n] - base[n]).abs().max().item() for n in base)
                         for s, r in runs.items()},
            "modes": {s: sorted(r["modes"]) for s, r in runs.items()}}


def _auto(dims) -> dict:
    """``"auto"``: a forward without autograd splits, a training forward does not; both give
    the unsplit loss."""
    m = _model(dims, "auto")
    x = _tokens(4)
    with torch.no_grad():
        evaluated = m.loss(m(x), x).item()
    eval_modes = _forward_modes(m)
    for mod in m.modules():
        if hasattr(mod, "plan"):
            mod.plan.stats.reset()
    trained = m.loss(m(x), x).item()
    plain = _model(dims, 1)
    with torch.no_grad():
        want = plain.loss(plain(x), x).item()
    return {"eval": evaluated, "train": trained, "want": want, "eval_modes": sorted(eval_modes),
            "train_modes": sorted(_forward_modes(m))}


def _hooked(dims) -> list[str]:
    """A block with a forward pre-hook (as ZeRO's parameter gathers install) runs whole, its
    hook called; the other block still splits."""
    m = _model(dims, 2)
    calls = []
    m.layers["1"].register_forward_pre_hook(lambda mod, args: calls.append(1))
    x = _tokens(4)
    m.loss(m(x), x).backward()
    return [m.layers[str(i)].attn.o.plan.stats.forward.mode for i in (1, 2)] + [str(len(calls))]


def _bias_guard(dims) -> str:
    """A deferred row-parallel Function refuses a bias (it would land on a partial sum that
    is still being reduced)."""
    from distllm.nn import RowParallelLinear
    from distllm.parallel.tensor import row_parallel_matmul
    from distllm.parallel.tensor.batch_split import defer_reductions

    layer = RowParallelLinear(8, 4, dims, dtype=DT)
    x = torch.randn(3, 4, dtype=DT)
    with defer_reductions():
        try:
            row_parallel_matmul(x, layer.weight, layer.bias, layer.plan, False)
        except RuntimeError as e:
            return str(e)
    return "no error"


def _reads_partial_sums(dims) -> dict[str, str]:
    """Sublayers whose output is not their one row-parallel output: refused on every rank
    (a parallel attention + MLP block sums two partial sums; an op after the layer reads
    one); the row-parallel output itself, bias included, matches the dense layer."""
    from torch import nn

    from distllm.nn import RowParallelLinear
    from distllm.parallel.tensor.batch_split import defer_reductions, split_residual

    torch.manual_seed(0)
    d1, d2 = nn.Linear(8, 8, dtype=DT), nn.Linear(8, 8, dtype=DT)
    r1, r2 = (RowParallelLinear.from_dense(d, dims, input_is_parallel=False, overlap="none")
              for d in (d1, d2))
    x = torch.randn(4, 3, 8, dtype=DT)
    out = {}
    for name, f in (("parallel block", lambda t: r1(t) + r2(t)), ("op after", lambda t: 2 * r1(t)),
                    ("two in a row", lambda t: r2(r1(t)))):
        try:
            with torch.no_grad():
                split_residual([f], x, parts=2)
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    try:  # finish() itself, outside split_residual: waits, then refuses
        with torch.no_grad(), defer_reductions() as d:
            y = r1(x) + r2(x)
        d.finish(y)
        out["finish"] = "no error"
    except RuntimeError as e:
        out["finish"] = str(e)
    with torch.no_grad():  # nothing left in flight by the refusals: this one runs
        got = split_residual([r1, r2], x, parts=2)
        want = x + d1(x)
        want = want + d2(want)
    out["one layer"] = f"{(got - want).abs().max().item():.3e}"
    return out


def split_main() -> dict:
    from distllm import ParallelDims

    dims = ParallelDims(tp=2)
    torch.manual_seed(0)
    return run_cases({
        "parity": lambda: _parity(dims),
        "auto": lambda: _auto(dims),
        "hooked": lambda: _hooked(dims),
        "bias_guard": lambda: _bias_guard(dims),
        "reads_partial_sums": lambda: _reads_partial_sums(dims),
    })


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=180)


def test_split_matches_the_single_process_model_and_the_unsplit_gradients(spawned):
    for got in case_of(spawned(split_main, 2), "parity"):
        for s, loss in got["loss"].items():
            assert abs(loss - got["want"]) <= TOL * abs(got["want"]), (s, got)
        assert got["grad_err"][2] < TOL and got["grad_err"][3] < TOL, got
        # the split runs left their all-reduces in flight; the unsplit one ran the engine
        assert got["modes"][2] == ["deferred"] and got["modes"][3] == ["deferred"], got
        assert "deferred" not in got["modes"][1], got


def test_auto_splits_only_a_forward_without_autograd(spawned):
    for got in case_of(spawned(split_main, 2), "auto"):
        assert got["eval_modes"] == ["deferred"] and "deferred" not in got["train_modes"], got
        assert abs(got["eval"] - got["want"]) <= TOL * abs(got["want"]), got
        assert abs(got["train"] - got["want"]) <= TOL * abs(got["want"]), got


def test_a_block_with_hooks_runs_whole(spawned):
    for got in case_of(spawned(split_main, 2), "hooked"):
        assert got[0] != "deferred" and got[1] == "deferred" and got[2] == "1", got


def test_a_deferred_function_refuses_a_bias(spawned):
    for got in case_of(spawned(split_main, 2), "bias_guard"):
        assert "takes its bias later" in got, got


def test_a_sublayer_reading_a_partial_sum_is_refused(spawned):
    for got in case_of(spawned(split_main, 2), "reads_partial_sums"):
        for name in ("parallel block", "op after", "two in a row", "finish"):
            assert "must return its one row-parallel layer's output unchanged" in got[name], got
        assert "launched 2 deferred" in got["parallel block"], got
        assert "launched 1 deferred all-reduce(s) and returned another tensor" in got["op after"]
        assert float(got["one layer"]) < TOL, got


def test_batch_split_values():
    assert check_batch_split("auto", 2, False, "auto") == "auto"
    assert check_batch_split("auto", 2, False, "none") == 1  # no overlap asked for
    assert check_batch_split(3, 2, False, "none") == 3  # asked for explicitly
    assert check_batch_split(2, 1, False, "auto") == 1  # nothing to overlap without TP
    assert check_batch_split(2, 2, True, "auto") == 1  # sequence parallelism reduce-scatters
    for bad in (0, -1, True, "two", 1.5):
        with pytest.raises(ValueError, match="batch_split"):
            check_batch_split(bad, 2, False, "auto")
    with pytest.raises(ValueError, match="--batch-split -1"):
        ParallelConfig(tp=2, batch_split=-1)
