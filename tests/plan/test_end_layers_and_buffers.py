"""What the planner charges the embedding, the head and ZeRO's gradient buffers: the
collectives the vocab-parallel embedding really runs (counted on a fake process group),
``--explain``'s embedding/head line under a pipeline, and the full-size gradient
accumulation buffers reported as their own memory entry."""

from __future__ import annotations

import json

import pytest
import torch

from distllm.cli import main
from distllm.plan import CostModel, Layout, load_profile, preset
from distllm.plan.collectives import collective_time
from distllm.plan.comm_cpu import rank_collective_cpu

A100 = load_profile("a100-80gb")
CPU = load_profile("cpu")


def _embedding_collectives(sp: bool, monkeypatch) -> dict[str, list[str]]:
    """The collectives ``VocabParallelEmbedding`` runs at tp=2 in forward and in backward
    (rank 0 of a fake 2-rank process group: every collective returns at once)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distllm.nn import VocabParallelEmbedding
    from distllm.parallel.mesh import ParallelDims
    from distllm.parallel.tensor import mappings

    seen: dict[str, list[str]] = {"forward": [], "backward": []}
    phase = ["forward"]
    for name, kind in (("all_reduce", "all_reduce"), ("reduce_scatter", "reduce_scatter"),
                       ("all_gather_into", "all_gather")):
        real = getattr(mappings, name)

        def counted(*a, _kind=kind, _real=real, **k):
            seen[phase[0]].append(_kind)
            return _real(*a, **k)

        monkeypatch.setattr(mappings, name, counted)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        emb = VocabParallelEmbedding(64, 8, ParallelDims(tp=2, pp=1, dp=1),
                                     sequence_parallel=sp)
        out = emb(torch.randint(0, 64, (2, 4)))
        phase[0] = "backward"
        out.float().sum().backward()
    finally:
        dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_the_embedding_is_charged_the_collectives_it_runs(sp, monkeypatch):
    """VocabParallelEmbedding all-reduces in forward and runs nothing in backward; under
    sequence parallelism it reduce-scatters in forward and all-gathers in backward. The time
    model charges exactly those, once (it used to charge the forward's in backward too), and
    so does the CPU model of the ranks' lockstep collectives."""
    ran = _embedding_collectives(sp, monkeypatch)
    assert ran == ({"forward": ["reduce_scatter"], "backward": ["all_gather"]} if sp
                   else {"forward": ["all_reduce"], "backward": []}), ran
    shape = preset("gpt2-medium").with_(global_batch=8)
    cm = CostModel(shape, A100, 2, 8)
    lay = Layout(2, 1, 1, 0, "none", 1, "none", sp, 1)
    assert shape.splits_vocab(2, sp)
    b = shape.global_batch
    msg, link = 2 * b * shape.seq_len * shape.hidden, cm._link("tp", lay)
    f, bw = (sum(collective_time(k, msg, 2, link) for k in ran[p])
             for p in ("forward", "backward"))
    emb_f, emb_b, *_, emb_c, _ = cm._ends(b, lay)
    assert emb_f - emb_b == pytest.approx(f - bw, rel=1e-12)
    assert emb_c == pytest.approx(f + bw, rel=1e-12)
    # the first pipeline stage (the embedding and blocks): its forward and backward beyond
    # its blocks, and the TP communication in them
    pp2 = Layout(2, 2, 1, 0, "1f1b", 2, "none", sp, 1)
    cm4 = CostModel(shape, A100, 4, 8)
    tf, tb, _, tc = cm4.rank_times(pp2)
    lt = cm4.layer_times(b // 2, pp2)
    n = cm4.ranks(2, 1)[0][0]
    assert cm4.ranks(2, 1)[0][1:] == (True, False)
    extra_f = tf[0] - n * (lt["fwd"] + lt["tp_f"])
    extra_b = tb[0] - n * (lt["bwd"] + lt["tp_b"])
    msg2 = msg / 2
    f2, bw2 = (sum(collective_time(k, msg2, 2, link) for k in ran[p])
               for p in ("forward", "backward"))
    assert extra_f - extra_b == pytest.approx(f2 - bw2, rel=1e-9)
    assert tc[0] - n * (lt["tp_f"] + lt["tp_b"]) == pytest.approx(f2 + bw2, rel=1e-9)
    # the CPU profile's lockstep collectives, with the blocks' and the head's: one TP sync
    # point (an all-reduce, or an all-gather and a reduce-scatter) for the embedding
    from distllm.plan.comm_cpu import _lockstep, _tp_cpu

    cpu = CostModel(preset("tiny").with_(global_batch=8, vocab=8192), CPU, 2, 2,
                    dtype="float32")
    tokens = 8 * cpu.shape.seq_len
    one = _tp_cpu(cpu, 4 * tokens * cpu.shape.hidden, lay)
    head = _lockstep(cpu, lay, 8, 0, False, True)
    assert one > 0
    assert _lockstep(cpu, lay, 8, 0, True, False) == pytest.approx(one, rel=1e-12)
    blocks = cpu.ranks(1, 1)[0][0]
    assert rank_collective_cpu(cpu, lay)[0][0] == pytest.approx(
        4 * blocks * one + one + head, rel=1e-12)


def test_explain_ends_hold_the_head_and_the_terms_add_up_under_a_pipeline(capsys):
    """pp=2, 1F1B, 16 micro-batches: the pipeline less its bubble is 16 x the slowest
    rank's forward + backward, which holds no transfer (the bubble holds what shows of
    them), so the embedding/head line is that rank's work beyond its blocks (here the last
    rank's head), not that less the transfers; the transfers are shown, not added."""
    argv = ["plan", "--model", "gpt2-medium", "--global-batch", "16", "--gpus", "2",
            "--gpus-per-node", "1", "--pp", "2", "--schedule", "1f1b", "--micro-batches", "16",
            "--checkpointing", "none", "--explain", "--json"]
    assert main(argv) == 0
    best = json.loads(capsys.readouterr().out)["ranked"][0]
    terms = best["step_terms_s"]
    shape = preset("gpt2-medium").with_(global_batch=16)
    cm = CostModel(shape, A100, 2, 1)
    lay = Layout(1, 2, 1, 0, "1f1b", 16, "none", False, 1)
    _, _, head_f, head_b, *_ = cm._ends(1, lay)
    assert terms["ends"] >= 16 * (head_f + head_b) * (1 - 1e-9), (terms, head_f + head_b)
    assert terms["pp_p2p_total"] > 0
    added = sum(v for k, v in terms.items() if k not in ("step", "pp_p2p_total"))
    assert added == pytest.approx(terms["step"], rel=1e-9)
    # the text says so
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert "not added: the exposed part is in the bubble" in out
    total = float(out.split(" s  sum of the terms")[0].split()[-1])
    assert total == pytest.approx(terms["step"], rel=1e-3)


def test_zero_accumulation_buffers_are_their_own_entry(capsys):
    """ZeRO-2/3 with more than one micro-batch accumulates into full-size fp32 gradient
    buffers: reported as ``grad_buffers`` (table, --explain, JSON), not as activations; the
    total is what it was."""
    shape = preset("gpt2-medium").with_(global_batch=32)
    cm = CostModel(shape, A100, 8, 8)
    four = Layout(1, 1, 8, 2, "none", 4, "none", False, 1)
    mem = cm.memory(four)
    n = cm.rank_params(four)[0][0]
    assert mem["grad_buffers"] == pytest.approx(4 * n, rel=1e-12)
    assert mem["grads"] == pytest.approx(4 * n / 8, rel=1e-12)  # the shard
    assert mem["activations"] < 2 * cm.memory(four._replace(zero=1))["activations"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"]
                                         + mem["activations"] + mem["grad_buffers"], rel=1e-12)
    assert cm.memory(four._replace(micro_batches=1))["grad_buffers"] == 0.0
    argv = ["plan", "--model", "gpt2-medium", "--global-batch", "32", "--gpus", "8",
            "--zero", "2", "--micro-batches", "4", "--tp", "1", "--pp", "1",
            "--checkpointing", "none", "--top", "1"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["ranked"][0]["memory_gb"]
    assert got["grad_buffers"] == pytest.approx(mem["grad_buffers"] / 1e9, abs=1e-6)
    assert got["activations"] == pytest.approx(mem["activations"] / 1e9, abs=1e-6)
    assert main([*argv, "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"grad buffers {mem['grad_buffers'] / 1e9:.3g}") == 2, out
    assert f"buf={mem['grad_buffers'] / 1e9:7.3f}" in out


def test_verify_compares_the_buffers_with_the_activations_it_measures(capsys):
    """The dry run cannot tell the accumulation buffers from the activations: ``--verify``
    sets the planner's two together against what it measures, and says so."""
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--gpu", "a100-80gb", "--tp", "1",
            "--pp", "1", "--zero", "2", "--micro-batches", "2", "--checkpointing", "none",
            "--global-batch", "4", "--seq-len", "64", "--verify"]
    assert main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["predicted_gb"]
    assert planned["grad_buffers"] > 0
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "act.+buffers" in x)
    assert float(line.split()[1]) == pytest.approx(
        planned["activations"] + planned["grad_buffers"], abs=1e-3)
    assert "with the gradient accumulation buffers" in line


def _engine_zero3_gathers(lay: Layout, pp_rank: int, monkeypatch) -> int:
    """ZeRO-3 all-gathers that the engine issues on pipeline rank ``pp_rank`` of ``lay`` in
    one step's forward-backward (a dry run of the tiny GPT: every collective is called, on
    fake tensors)."""
    import distllm.parallel.data.zero3 as zero3
    from distllm.plan.dry_run import dry_run
    from distllm.plan.verify import gpt_config_for, train_config_for
    from distllm.train.engine import Engine

    count, on = [0], [False]
    gather, fb = zero3.all_gather, Engine.forward_backward

    def counted(*a, **k):
        count[0] += on[0]
        return gather(*a, **k)

    def step(self, *a, **k):
        on[0] = True
        try:
            return fb(self, *a, **k)
        finally:
            on[0] = False

    monkeypatch.setattr(zero3, "all_gather", counted)
    monkeypatch.setattr(Engine, "forward_backward", step)
    shape = preset("tiny").with_(global_batch=lay.dp * lay.micro_batches, seq_len=32)
    dry_run(train_config_for(lay, shape, "float32"), gpt_config_for(shape),
            lay.tp * lay.pp * lay.dp, pp_rank=pp_rank)
    return count[0]


@pytest.mark.parametrize("lay", [
    Layout(1, 1, 4, 3, "none", 2, "none", False, 1),
    Layout(1, 2, 2, 3, "1f1b", 4, "none", False, 1),
    Layout(1, 2, 2, 3, "gpipe", 2, "none", False, 1),
    Layout(1, 2, 2, 3, "interleaved-1f1b", 2, "none", False, 2),
], ids=lambda lay: lay.name())
def test_zero3_gathers_are_those_the_engine_issues(lay, monkeypatch):
    """The engine keeps the last unit of a forward gathered, since backward starts with it
    (``ShardedParams._post_forward``): on a rank with one chunk, ``2 * units - 1`` gathers
    per micro-batch (dp4 m2: 22 a step; the planner charged 24, the head gathered again
    before each backward). Interleaved ranks issue at least two per unit and micro-batch
    (they re-gather): the planner charges those two. The time charges the head's forward
    gather alone, and the CPU model of its gathers the same."""
    cm = CostModel(preset("tiny").with_(global_batch=lay.dp * lay.micro_batches, seq_len=32),
                   CPU, lay.dp * lay.pp, 8)
    planned = cm.z3_gathers(lay)
    for r in range(lay.pp):
        engine = _engine_zero3_gathers(lay, r, monkeypatch)
        if lay.virtual_stages == 1:
            assert planned[r] == engine, (r, planned, engine)
        else:
            assert planned[r] <= engine and planned[r] == 2 * lay.micro_batches * 3
    if lay.pp > 1:
        return
    assert planned == [lay.micro_batches * (2 * (4 + 2) - 1)] == [22]
    # the seconds: every unit's forward gather, every unit's backward gather but the head's
    b = cm.shape.global_batch // (lay.dp * lay.micro_batches)
    lt = cm.layer_times(b, lay)
    emb, head = cm.end_params(lay)
    f_e, b_e, _ = cm._z3_unit(emb, lay, 0.0, lt["bwd"])
    f_h, b_h, _ = cm._z3_unit(head, lay, lt["fwd"], 0.0)
    assert b_h > 0  # what a second gather of the head would cost
    want = lay.micro_batches * (4 * (lt["z3_f"] + lt["z3_b"]) + f_e + b_e + f_h)
    assert cm.step_time(lay)[1]["zero3_gather"] == pytest.approx(want, rel=1e-12)
