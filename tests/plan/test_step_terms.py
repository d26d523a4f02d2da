"""``distllm plan --explain``: a predicted step term by term, and what changed in the GPT-3
175B prediction on 1024 A100s (the choice that claimed 63% MFU was tp8, ZeRO-3, dp128 with
two micro-batches: it did not count the full-size fp32 gradient buffers distllm's ZeRO-3
keeps while micro-batches accumulate)."""

from __future__ import annotations

import json

import pytest

from distllm.cli import main
from distllm.plan import CostModel, Layout, load_profile, preset
from distllm.plan.breakdown import step_terms
from distllm.plan.kernels import gemm_time

GB = 1e9
A100 = load_profile("a100-80gb")


def _cm(shape=None, world=1024, **kw) -> CostModel:
    return CostModel(shape or preset("gpt3-175b"), A100, world, 8, **kw)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(8, 1, 128, 3, "none", 1, "full", True, 1),
        Layout(8, 1, 128, 1, "none", 4, "selective", True, 1),
        Layout(4, 1, 256, 2, "none", 6, "full", False, 1),
    ],
    ids=lambda lay: lay.name(),
)
def test_terms_add_up_to_the_step_without_a_pipeline(lay):
    cm = _cm()
    est = cm.evaluate(lay)
    terms = step_terms(est, cm)
    total = sum(v for k, v in terms.items() if k != "step")
    assert total == pytest.approx(est.step_time_s, rel=1e-9), terms
    assert all(v >= 0 for v in terms.values()), terms


def test_zero3_dp128_two_micro_batches_does_not_fit():
    """distllm's ZeRO-3 reduce-scatters a block's gradients in the last micro-batch's
    backward; the earlier ones accumulate into full-size fp32 buffers: 4 bytes for each of
    the 21.9B parameters a tp=8 rank holds (the dry-run tests check this accounting). The
    activations alone (the sequence-parallel GEMMs keep their all-gathered inputs) do not
    fit either."""
    import dataclasses

    from distllm.plan.runtime import runtime

    two = Layout(8, 1, 128, 3, "none", 2, "none", True, 1)
    cm = _cm()
    shard_rt = dataclasses.replace(runtime("distllm"), zero_grad_accumulation="shard")
    per_shard = _cm(runtime_name=shard_rt).memory(two)
    mem = cm.memory(two)
    n = cm.rank_params(two)[0][0]
    assert n == pytest.approx(175e9 / 8, rel=0.01)
    # the full buffers, reported as such (the activations hold the one block's bucket a
    # per-micro-batch reduction would hold instead)
    assert mem["grad_buffers"] == 4 * n and per_shard["grad_buffers"] == 0.0
    buffers = mem["grad_buffers"] + mem["activations"] - per_shard["activations"]
    assert 4 * n - 4 * 2 * cm.rank_params(two)[1] < buffers <= 4 * n
    assert mem["total"] > per_shard["total"] > A100.usable_bytes
    one = two._replace(micro_batches=1)  # nothing to accumulate: the same either way
    assert cm.memory(one) == _cm(runtime_name=shard_rt).memory(one)


def test_zero3_gathers_are_charged_when_compute_cannot_hide_them():
    """Per block, a ZeRO-3 rank all-gathers its weights over dp (InfiniBand at dp*tp > 8)
    before forward and backward; with little compute per block the wire shows."""
    cm = _cm()
    lay = Layout(8, 1, 128, 3, "none", 12, "none", True, 1)  # one sequence per micro-batch
    lt = cm.layer_times(1, lay)
    link = A100.links["inter"]
    gather = (127 / 128) * cm.rank_params(lay)[1] * 2 * link.beta + 127 * link.latency
    assert lt["z3_f"] == pytest.approx(gather - link.overlap * lt["fwd"], rel=1e-9)
    assert lt["z3_f"] > 0 and step_terms(cm.evaluate(lay), cm)["zero3_gather"] > 1.0


def test_zero3_gathers_the_embedding_and_the_head_too():
    """The embedding and the head are ZeRO-3 units as a block is: gathered before their
    forward and backward (the head, which the backward starts with, stays gathered from its
    forward) and reduce-scattered. With a large vocabulary and two small blocks
    (550M parameters a rank, 25M of them in blocks) ZeRO-3 moves 1.25x ZeRO-2's bytes with
    almost nothing to hide them behind: its communication cannot come out below ZeRO-2's
    (it did, 13 ms against 157, when only the blocks' were charged)."""
    from distllm.plan.collectives import collective_time
    from distllm.plan.model import ModelShape

    shape = ModelShape("vocab-heavy", 2, 1024, 16, 4096, 256000, 512, 64, tied_embeddings=False)
    cm = CostModel(shape, A100, 64, 8, dtype="bfloat16")

    def comm(zero):
        t = cm.step_time(Layout(1, 1, 64, zero))[1]
        return t["dp_comm"] + t["zero_comm"], t["zero_comm"]

    emb, head = cm.end_params(Layout(1, 1, 64, 3))
    link = A100.links["inter"]
    ends = (collective_time("all_gather", 2 * (emb + head), 64, link)  # bf16, forward
            + collective_time("all_gather", 2 * emb, 64, link))  # backward
    assert comm(3)[1] >= ends > 0.9 * comm(3)[1]  # the ends' gathers are most of them
    assert comm(3)[0] > 1.2 * comm(2)[0]


def test_gemm_efficiency_by_shape():
    """A GEMM whose output tiles fill whole waves of SMs runs at max_efficiency *
    shape_fraction of peak; a last wave two-thirds full costs a third of a wave; a GEMM over
    a small k is bound by its bytes."""
    g, peak = A100.gemm, A100.flops("bfloat16")
    rate = peak * g.max_efficiency * g.shape_fraction
    m, n, k = 1536, 1152, 8192  # 12 x 9 = 108 tiles of 128x128: one full wave
    assert gemm_time(A100, peak, m, n, k) == pytest.approx(2 * m * n * k / rate, rel=1e-12)
    m, n, k = 2048, 4608, 12288  # 576 tiles of 128x128 (or 288 of 256x128): 5.33 waves
    want = 2 * m * n * k / rate * (6 * 108 / 576)
    assert gemm_time(A100, peak, m, n, k) == pytest.approx(want, rel=1e-12)
    s, d = 2048, 64  # attention scores over a small head dimension: memory-bound
    bytes_moved = 2 * (s * d + d * s + s * s)
    bound = bytes_moved / (A100.memory_bandwidth * A100.memory_efficiency)
    assert gemm_time(A100, peak, s, s, d) == pytest.approx(bound, rel=1e-12)


def test_cli_explain_175b(capsys):
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb",
            "--tp", "8", "--pp", "1", "--zero", "3", "--top", "1", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step of tp8.pp1.dp128.zero3.m1" in out
    for what in ("GEMMs", "tensor-parallel collectives", "MFU = model FLOPs"):
        assert what in out, out
    assert main([*argv, "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["ranked"][0]
    terms = top["step_terms_s"]
    assert terms["step"] == pytest.approx(top["step_time_s"], rel=1e-9)
    assert top["micro_batches"] == 1  # two would need the full fp32 gradient buffers
