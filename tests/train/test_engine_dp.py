"""The engine's data-parallel side: at ZeRO stages 1 and 2 the parameter all-gathers that
end a step are launched, not waited for, first layers first (their bucket stepped and sent
before the optimizer steps the others), and each is waited for by the next forward of the
layers that use it; ``update`` reduces the norm, the inf/NaN flag and the loss in one
all-reduce; on 2 gloo ranks every all-reduce of a step (TP, DDP, PP) is the
exchange; the losses still equal the single-process run's (float64, weight decay, clipping
and warm-up on), on 2 ranks and on 4 with TP and PP beside ZeRO."""

from __future__ import annotations

import pytest

from distllm.testing import run_distributed
from tests._collectives import counted_all_reduces
from tests.train._util import make_cfg, train_many

TOL = 1e-12  # float64: layouts differ only in summation order


def _gathers_rank(data: str, out: str, zero: int) -> dict:
    import torch

    from distllm import ParallelDims
    from distllm.parallel.data import zero_gather
    from distllm.train.engine import Engine

    cfg = make_cfg(data, out, dp=2, zero=zero)
    dims = ParallelDims(dp=2)
    eng = Engine(cfg, cfg.model_config(), dims)
    order: list[int] = []
    # each inner optimizer step, as the buckets whose segments it stepped (had a gradient),
    # and each gather launch, in the order they ran
    events: list = []
    launch = zero_gather.ParamGathers.launch

    def spy(self, i, flat, shard):
        order.append(i)
        events.append(("gather", i))
        return launch(self, i, flat, shard)

    zero_gather.ParamGathers.launch = spy
    inner = eng.zero.optimizer.step

    def step_spy(*args, **kwargs):
        events.append(("step", sorted({s.bucket for s in eng.zero.segments
                                       if s.tensor.grad is not None})))
        return inner(*args, **kwargs)

    eng.zero.optimizer.step = step_spy
    try:
        x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(dims.rank))
        loss = eng.forward_backward(x, x)
        with counted_all_reduces() as reduces:
            eng.update(1.0, loss)
        pending_after_step = sorted(eng.zero._gathers.pending)
        loss = eng.forward_backward(x, x)  # the forward's pre-hooks wait for the gathers
        pending_after_forward = sorted(eng.zero._gathers.pending)
        eng.update(1.0, loss)
    finally:
        zero_gather.ParamGathers.launch = launch
    return {"overlapped": eng.zero._gathers.overlapped, "order": order,
            "buckets": len(eng.zero.reducer.buckets), "after_step": pending_after_step,
            "after_forward": pending_after_forward, "update_reduces": reduces,
            "events": events}


@pytest.mark.parametrize("zero", [1, 2])
def test_param_gathers_overlap_the_next_forward(corpus, tmp_path, zero):
    got = run_distributed(_gathers_rank, 2, corpus, str(tmp_path), zero, timeout=300)[0]
    n = got["buckets"]
    assert got["overlapped"]
    assert n > 1  # the order below means something
    assert got["order"] == list(reversed(range(n))) * 2  # first layers (last bucket) first
    assert got["after_step"] == list(range(n))  # launched by the step, none waited for
    assert got["after_forward"] == []
    # the first layers' bucket is stepped alone and its gather launched before the optimizer
    # steps the others (so it runs during the rest of the step); every bucket stepped once
    one_step = [("step", [n - 1]), ("gather", n - 1), ("step", list(range(n - 1))),
                *(("gather", i) for i in reversed(range(n - 1)))]
    assert got["events"] == one_step * 2
    # the norm's squares, the inf/NaN flag and the loss: one all-reduce of 3 values (on 2
    # gloo ranks, the exchange)
    assert got["update_reduces"] == [("exchange", 3)]


def _zero3_build_rank(data: str, out: str, tp: int) -> dict:
    from distllm import ParallelDims
    from distllm.models import sharding
    from distllm.train.engine import Engine

    cfg = make_cfg(data, out, dp=2, tp=tp, zero=3)
    dims = ParallelDims(tp=tp, dp=2)
    live, init = [], sharding.init_params
    holder: list = []

    def spy(model, params, seed):
        # the elements of every chunk's parameters that hold memory as a layer is initialised
        holder.append(model)
        live.append((sum(p.numel() for p in model.parameters()
                         if not p.is_meta and p.untyped_storage().nbytes() > 0),
                     sum(p.numel() for p in params)))
        return init(model, params, seed)

    sharding.init_params = spy
    try:
        eng = Engine(cfg, cfg.model_config(), dims)
    finally:
        sharding.init_params = init
    return {"live": live, "layers": len(eng.chunks[0].layer_ids),
            "same_model": all(m is eng.chunks[0] for m in holder)}


@pytest.mark.parametrize("tp", [1, 2])
def test_zero3_never_holds_the_stage_whole(corpus, tmp_path, tp):
    """At ZeRO-3 the engine builds its chunks on the meta device and ZeroOptimizer
    materialises, initialises and shards one layer at a time: while a layer is initialised,
    its parameters are the only ones holding memory (its values: the parity runs below)."""
    got = run_distributed(_zero3_build_rank, 2 * tp, corpus, str(tmp_path), tp,
                          timeout=300)[0]
    assert got["same_model"] and len(got["live"]) == got["layers"]
    assert all(live == mine > 0 for live, mine in got["live"]), got["live"]


# ogr: --overlap-grad-reduce ("off": every gradient bucket reduced after backward)
LAYOUTS = {2: [dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
               dict(dp=2, ogr="off"), dict(dp=2, zero=2, ogr="off"), dict(dp=2, ogr="on")],
           4: [dict(pp=2, dp=2, schedule="zb-h1", m=2, zero=1), dict(tp=2, dp=2, zero=2)]}


@pytest.mark.parametrize("world", [2, 4])
def test_zero_parity(corpus, reference, reference_weights, tmp_path, world):
    """The losses and, after the last step, every weight (1e-10) of the one-process run."""
    from distllm.train.checkpoint import read_layers

    runs = [dict(steps=60, stop_after=3, save_final=True, **kw) for kw in LAYOUTS[world]]
    res = run_distributed(train_many, world, runs, corpus, str(tmp_path), timeout=900)[0]
    for i, (kw, losses) in enumerate(zip(LAYOUTS[world], res, strict=True)):
        assert len(losses) == 3
        for step, (a, b) in enumerate(zip(losses, reference[:3], strict=True)):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{kw} step {step + 1}: {a} vs {b}"
        last = read_layers(tmp_path / f"run{i}" / "checkpoints" / "step_00000003")[1]
        assert last.keys() == reference_weights.keys(), kw
        for j, layer in reference_weights.items():
            assert last[j].keys() == layer.keys(), (kw, j)
            for name, want in layer.items():
                diff = float((last[j][name] - want).abs().max())
                assert diff <= 1e-10, f"{kw} layer {j} {name}: max difference {diff:.3g}"


def _step_reduces_rank(data: str, out: str, layout: dict) -> list[tuple[str, int]]:
    import torch

    from distllm import ParallelDims
    from distllm.train.engine import Engine

    cfg = make_cfg(data, out, **layout)
    p = cfg.parallel
    dims = ParallelDims(tp=p.tp, pp=p.pp, dp=p.dp)
    eng = Engine(cfg, cfg.model_config(), dims)
    x = torch.randint(0, 256, (8 // dims.dp, 32), generator=torch.Generator().manual_seed(1))
    eng.update(1.0, eng.forward_backward(x, x))  # warm: the overlap choices are made here
    with counted_all_reduces() as reduces:
        eng.update(1.0, eng.forward_backward(x, x))
    return reduces


# TP with the vocabulary-parallel cross-entropy and the chunked row-parallel overlap; DDP
# (ZeRO-0); the pipeline's loss and norm
STEP_LAYOUTS = [dict(tp=2, vp="on", overlap="chunked"), dict(dp=2), dict(pp=2, m=2)]


@pytest.mark.parametrize("layout", STEP_LAYOUTS, ids=["tp2", "dp2", "pp2"])
def test_two_rank_step_all_reduces_by_exchange(corpus, tmp_path, layout):
    """On 2 gloo ranks every all-reduce of a training step (TP's row-parallel outputs, bias
    gradients and cross-entropy; DDP's buckets; the norm, flag and loss) is the exchange."""
    for rank, got in enumerate(run_distributed(_step_reduces_rank, 2, corpus, str(tmp_path),
                                               layout, timeout=300)):
        kinds = {k for k, _ in got}
        assert kinds == {"exchange"}, (rank, got)
        assert got[-1] == ("exchange", 2), (rank, got)  # the step's norm squares and loss


def _skip_rank(data: str, out: str, layout: dict) -> list[dict]:
    """Three steps; before the second's update an inf lands in one gradient of rank 1 only."""
    import torch

    from distllm import ParallelDims
    from distllm.train.engine import Engine

    layout = dict(layout)
    replicated = layout.pop("replicated", False)
    cfg = make_cfg(data, out, **layout)
    dims = ParallelDims(tp=layout.get("tp", 1), dp=layout.get("dp", -1))
    eng = Engine(cfg, cfg.model_config(), dims)
    g = torch.Generator().manual_seed(3)
    res = []
    for step in range(3):
        tok = torch.randint(eng.mcfg.vocab_size, (8 // dims.dp, 32), generator=g)
        hook = None
        if step == 1 and dims.rank == 1:  # in backward, before any reduction sees it
            # under TP, a shard's gradient, or (``replicated``) one copy of a parameter every
            # TP rank holds whole, which the norm counts on TP rank 0 only: the fault is in
            # rank 1's copy
            first = next(p for c in eng.chunks for p in c.parameters()
                         if dims.tp == 1
                         or getattr(p, "tensor_model_parallel", False) != replicated)
            hook = first.register_hook(lambda grad: grad.index_fill(0, grad.new_zeros(
                1, dtype=torch.long), float("inf")))
        loss = eng.forward_backward(tok, tok.roll(-1, 1))
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for c in eng.chunks for p in c.parameters()]
        out = eng.update(cfg.optim.grad_clip, loss=loss)
        if eng.zero is not None:  # ZeRO-1/2 all-gathers the updated weights after the step,
            eng.zero.wait_params()  # behind the next forward: read them once they are whole
        after = [p.detach() for c in eng.chunks for p in c.parameters()]
        res.append({"skipped": out.skipped,
                    "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                    "finite": all(bool(torch.isfinite(a).all()) for a in after)})
    return res


@pytest.mark.parametrize("layout", [dict(dp=2), dict(tp=2), dict(tp=2, replicated=True),
                                    dict(dp=2, zero=2), dict(tp=2, zero=1, replicated=True)],
                         ids=["dp2-ddp", "tp2-ddp", "tp2-ddp-replicated", "dp2-zero2",
                              "tp2-zero1-replicated"])
def test_an_inf_gradient_on_one_rank_skips_the_step_everywhere(corpus, tmp_path, layout):
    """DDP as ZeRO: an inf/NaN gradient on any rank skips the optimizer step on every rank
    (DDP reads it in the global norm, which every rank shares); the weights stay finite."""
    for rank, got in enumerate(run_distributed(_skip_rank, 2, corpus, str(tmp_path), layout,
                                               timeout=300)):
        assert [r["skipped"] for r in got] == [False, True, False], (rank, got)
        assert [r["moved"] for r in got] == [True, False, True], (rank, got)
        assert all(r["finite"] for r in got), (rank, got)
