"""The training engine's step on a (fake) CUDA job, as ``distllm train`` builds it: clipping,
the ZeRO inf/NaN flag, the loss reduction for the metrics and one host read per step; and
what a checkpoint saves (this rank's boxes of the weights and AdamW moments) and installs."""

from __future__ import annotations

import pytest
import torch

from distllm.comm.compat import ALL_GATHER_API
from distllm.train.checkpoint_state import own_pieces, read_targets
from distllm.train.engine import Engine
from distllm.train.optim_state import MOMENTS
from tests.device._fakecuda import CUDA, CudaDims, emulate_backward, fake_world
from tests.train._util import make_cfg

AG = ALL_GATHER_API  # torch's name for the all-gather, as compat picks it
LAYOUTS = {  # name: (world, make_cfg options)
    "tp2-ddp": (2, dict(tp=2)),
    "dp2-ddp": (2, dict(dp=2)),
    "dp2-zero1": (2, dict(dp=2, zero=1)),
    "tp2.dp2-zero2": (4, dict(tp=2, dp=2, zero=2)),
    "dp2-zero3-bf16": (2, dict(dp=2, zero=3, dtype="bfloat16")),
    "pp2-ddp": (2, dict(pp=2, m=2)),
}


def _build(tmp_path, world: int, opts: dict) -> Engine:
    opts = {"dtype": "float32", **opts}
    p = {k: opts.pop(k) for k in ("tp", "pp", "dp") if k in opts}
    cfg = make_cfg(str(tmp_path / "data.txt"), str(tmp_path), **p, **opts)
    dims = CudaDims(tp=p.get("tp", 1), pp=p.get("pp", 1), dp=p.get("dp", -1))
    assert dims.world_size == world
    return Engine(cfg, cfg.model_config(), dims)


def _backward(monkeypatch, engine: Engine) -> None:
    """Gradients for every parameter, last first, as the backward pass would leave them
    (ZeRO-3: each layer gathered before its gradients land)."""
    sh = engine.zero.sharded if engine.zero is not None else None
    params = [p for c in engine.chunks for p in c.parameters()]
    if sh is None:
        steps: list = [(p, None) for p in reversed(params)]
    else:
        steps = [lambda: sh._pre_backward(sh.module)]
        for u in reversed(sh.units[:-1]):
            steps.append(lambda u=u: sh._pre_backward(u))
            steps += [(p, None) for f in sh.flats[u] for p in f.params]
        steps += [(p, None) for f in sh.flats[sh.module] for p in f.params]
    emulate_backward(monkeypatch, steps)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_update_on_cuda(cuda_job, monkeypatch, tmp_path, layout):
    rec, host = cuda_job
    world, opts = LAYOUTS[layout]
    with fake_world(world):
        engine = _build(tmp_path, world, opts)
        assert all(p.device == CUDA for c in engine.chunks for p in c.parameters())
        for _ in range(2):
            _backward(monkeypatch, engine)
            before = len(host.syncs)
            loss = torch.tensor(2.5, dtype=torch.float64, device=CUDA)
            out = engine.update(1.0, loss=loss)
            reads = host.syncs[before:]
            assert [how for how, _ in reads] == ["tolist"], f"one host read per step: {reads}"
            assert out.skipped is False
    zero_dp = engine.zero is not None and engine.zero.nranks > 1
    rec.check(expect={"all_reduce", AG} if zero_dp else {"all_reduce"})


def test_engine_skips_the_step_its_one_read_flags(cuda_job, monkeypatch, tmp_path):
    """The inf/NaN flag read with the metrics decides the step: no second read."""
    rec, host = cuda_job
    host.value = lambda t: 1.0  # every metric reads as 1: found_inf too
    with fake_world(2):
        engine = _build(tmp_path, 2, dict(dp=2, zero=2))
        _backward(monkeypatch, engine)
        out = engine.update(1.0, loss=torch.tensor(2.5, dtype=torch.float64, device=CUDA))
    assert out.skipped and engine.zero.skipped_steps == 1
    assert not engine.zero.optimizer.state  # AdamW never stepped
    assert [how for how, _ in host.syncs] == ["tolist"], host.syncs
    rec.check(expect={"all_reduce"})


@pytest.mark.parametrize("layout", ["tp2-ddp", "dp2-ddp", "dp2-zero1", "dp2-zero3-bf16"])
def test_checkpoint_boxes_and_install_on_cuda(cuda_job, monkeypatch, tmp_path, layout):
    """A save hands DCP views of this rank's state where it lives, on the device (DCP copies
    each box to the CPU as it writes it), with no collective; a load fills CPU boxes (as DCP
    reads them) and installs them next to the parameters, so the next AdamW step does not
    mix devices."""
    rec, _ = cuda_job
    world, opts = LAYOUTS[layout]
    with fake_world(world):
        engine = _build(tmp_path, world, opts)
        _backward(monkeypatch, engine)
        engine.update(1.0)
        pieces, _ = own_pieces(engine)  # (its step count: a host read, faked here)
        keys = {k.rsplit(".", 1)[-1] for k in pieces if k.startswith("optim.")}
        assert keys == set(MOMENTS), keys
        boxes = [t for _, b in pieces.values() for _, t in b]
        assert boxes and all(t.device == CUDA for t in boxes)
        targets, commit = read_targets(engine, with_optim=True)
        assert targets.keys() == pieces.keys()
        for _, b in targets.values():  # what DCP hands back: CPU tensors, filled
            for _, t in b:
                assert t.device.type == "cpu"
                t.fill_(0.5)
        commit(3)
        opt = engine.zero.optimizer if engine.zero is not None else engine.optimizer
        assert opt.state
        for st in opt.state.values():
            for key in MOMENTS:
                assert st[key].device == CUDA, (key, st[key].device)
            # the engine's AdamW is fused: its kernel takes the step count on the
            # parameters' device in fp32 (torch's load_state_dict puts it there too)
            assert st["step"].device == CUDA and st["step"].dtype == torch.float32, st["step"]
        _backward(monkeypatch, engine)
        engine.update(1.0)
    zero_dp = engine.zero is not None and engine.zero.nranks > 1
    rec.check(expect={"all_reduce", AG} if zero_dp else {"all_reduce"})


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_gpt_forward_and_loss_on_cuda(cuda_job, tmp_path, sp):
    """The model's forward as the engine runs it (vocab-parallel embedding, attention, the
    MLP's fused GEMMs, ``overlap="auto"``, the vocab-parallel cross-entropy) on CUDA."""
    rec, host = cuda_job
    with fake_world(2):
        engine = _build(tmp_path, 2, dict(tp=2, sp=sp, overlap="auto"))
        vocab = engine.mcfg.vocab_size
        tok = torch.randint(vocab, (2, 32)).to(CUDA)
        with torch.no_grad():
            model = engine.chunks[0]
            loss = model.loss(engine._forward(model, tok), tok)
    assert loss.device == CUDA and loss.dim() == 0
    assert all(how == "tolist" and where.startswith("diagnostics/timing.py")
               and where.endswith("(max_over_ranks)")
               for how, where in host.syncs), host.syncs  # the auto-tuner's measurements
    rec.check(expect={"all_reduce", AG} if sp else {"all_reduce"})
