"""The planner's memory against a dry run of the real training code (``distllm plan
--verify``): distllm's engine built for one rank of a layout on fake tensors and the fake
process-group backend, one steady-state step, every storage counted.

Targets: within 10% for DP, ZeRO-1/2/3 and pipeline layouts of gpt2-xl at 8 to 64 fake
ranks. Two layouts run by default (ZeRO-3, whose gathered units the dry run must see freed
by ``resize_``, and a 4-stage pipeline on 64 ranks, whose peak is its activations in
flight); the rest, and GPT-3 175B, in ``make test-full``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from distllm.cli import main
from distllm.plan import Layout, ModelShape, preset
from distllm.plan.dry_run import dry_run
from distllm.plan.verify import train_config_for, verify

TOLERANCE = 0.10  # the target: the planner within 10% of the dry run's peak

GPT2XL = {  # name: (layout, micro-batches are the layout's; batch = dp * m sequences)
    "dp8-zero3": Layout(1, 1, 8, 3, "none", 1, "none", False, 1),
    "pp4.dp16-zero1": Layout(1, 4, 16, 1, "1f1b", 4, "none", False, 1),
}
GPT2XL_FULL = {
    "dp8-ddp": Layout(1, 1, 8, 0, "none", 1, "none", False, 1),
    "dp8-zero1": Layout(1, 1, 8, 1, "none", 1, "none", False, 1),
    "dp8-zero2": Layout(1, 1, 8, 2, "none", 1, "none", False, 1),
    "dp8-zero2-m2": Layout(1, 1, 8, 2, "none", 2, "none", False, 1),
    "dp64-zero3": Layout(1, 1, 64, 3, "none", 1, "none", False, 1),
    "pp2.dp4-interleaved": Layout(1, 2, 4, 0, "interleaved-1f1b", 4, "none", False, 2),
    "pp2.dp4-1f1b": Layout(1, 2, 4, 0, "1f1b", 4, "none", False, 1),
}


def _check(lay: Layout, model: str = "gpt2-xl", seq: int = 0):
    shape = preset(model)
    shape = shape.with_(global_batch=lay.dp * lay.micro_batches, seq_len=seq or shape.seq_len)
    # a pipeline's first stage holds the most micro-batches in flight
    v = verify(shape, lay, pp_rank=0 if lay.pp > 1 else None)
    assert abs(v.error) < TOLERANCE, v.report()
    # the states are exact: the planner counts what the engine allocates
    for key in ("grads", "optimizer"):
        assert v.predicted[key] == pytest.approx(v.measured.states[key], rel=0.01), v.report()
    return v


@pytest.mark.parametrize("name", list(GPT2XL))
def test_gpt2_xl_dry_run_agrees_with_the_planner(name):
    _check(GPT2XL[name])


@pytest.mark.full
@pytest.mark.parametrize("name", list(GPT2XL_FULL))
def test_gpt2_xl_dry_run_agrees_with_the_planner_full(name):
    _check(GPT2XL_FULL[name])


@pytest.mark.full
def test_gpt3_175b_dry_run():
    """One rank of GPT-3 175B at tp=8, pp=16, dp=8 (1024 devices): 6 blocks of 1.8B
    parameters each on fake tensors, with full recomputation."""
    v = _check(Layout(8, 16, 8, 1, "1f1b", 16, "full", False, 1), "gpt3-175b")
    assert v.measured.world == 1024
    assert v.measured.states["params"] == pytest.approx(v.predicted["params"], rel=1e-3)


@pytest.mark.parametrize("dtype, checkpointing", [
    ("float32", "none"), ("float32", "full"), ("float64", "none"), ("bfloat16", "none")])
def test_one_dp_rank_in_each_dtype(dtype, checkpointing):
    """gpt2-small on one DP rank, one micro-batch of two sequences: the vocabulary-heavy
    case, where the head's logits weigh. In fp32 and fp64 no reducer holds the gradients:
    autograd creates them in backward as it frees the activations and frees them after the
    step; the planner counted both at once (+22% at gpt2-medium, +30% with full
    recomputation). It counted an fp32 copy of fp32 logits for the softmax, and of their
    gradient (+9% at dp 2 in fp32, with recomputation). The dry run measured a first step
    there, before torch's AdamW had its states (it creates a parameter's at its first
    gradient): the forward-backward peak without them."""
    lay = Layout(1, 1, 1, 0, "none", 1, checkpointing, False, 1)
    v = verify(preset("gpt2-small").with_(global_batch=2, seq_len=1024), lay, dtype=dtype)
    assert abs(v.error) < 0.05, v.report()
    m = v.measured
    assert m.states["optimizer"] == pytest.approx(v.predicted["optimizer"], rel=1e-6)
    if dtype != "bfloat16":  # (16-bit: fp32 master gradients, held all the step)
        assert m.states["grads"] == 0
        held = m.states["params"] + m.states["optimizer"]  # through the measured step
        assert m.phases["forward-backward"] > held + 0.5 * v.predicted["grads"], v.report()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vocabulary_split_over_two_ranks(dtype):
    """gpt2-small at tp2, one micro-batch of two sequences of 1024: half the vocabulary's
    logits per rank. The vocab-parallel loss saves its softmax alone, the logits freed after
    its forward (Runtime.split_loss_frees_logits): the planner kept them through backward
    (+8.9% in fp32)."""
    lay = Layout(2, 1, 1, 0, "none", 1, "none", False, 1)
    v = verify(preset("gpt2-small").with_(global_batch=2, seq_len=1024), lay, dtype=dtype)
    assert abs(v.error) < 0.02, v.report()


@pytest.mark.parametrize("model, batch, lay, pp_rank", [
    ("gpt2-xl", 64, Layout(1, 4, 16, 1, "zb-h1", 4, "none", False, 1), 0),
    ("gpt2-xl", 64, Layout(1, 4, 16, 1, "zb-h1", 4, "none", False, 1), 3),
    ("gpt2-small", 16, Layout(1, 4, 1, 0, "zb-h1", 8, "none", False, 1), 3),
    ("gpt2-small", 8, Layout(2, 2, 1, 0, "zb-h1", 4, "none", False, 1), 1),
    ("gpt2-medium", 16, Layout(4, 2, 1, 0, "zb-h1", 8, "none", True, 1), 1),
], ids=["gpt2-xl-rank0", "gpt2-xl-rank3", "gpt2-small-pp4-rank3", "gpt2-small-tp2.pp2-rank1",
        "gpt2-medium-tp4.pp2.sp-rank1"])
def test_zero_bubble_dry_run_agrees_with_the_planner(model, batch, lay, pp_rank):
    """zb-h1 holds a micro-batch whole until B and then, until W, only what W needs: every
    deferred weight GEMM's input and output gradient (the attention's projections, the fused
    MLP's two GEMMs and the head, tensor-parallel or not) and the stage input. The last rank
    defers up to p micro-batches: counted whole, the planner read +43% at gpt2-small pp4 and
    +31% at tp2.pp2; counting the tensor-parallel layers and the MLP as computed in B, it
    read -22% at gpt2-xl rank 3 and -19% at gpt2-medium tp4.pp2.sp."""
    v = verify(preset(model).with_(global_batch=batch), lay, pp_rank=pp_rank)
    assert abs(v.error) < TOLERANCE, v.report()


@pytest.mark.parametrize("lay, pp_rank", [
    (Layout(1, 2, 8, 2, "interleaved-1f1b", 2, "none", False, 6), 0),
    (Layout(1, 2, 8, 2, "interleaved-1f1b", 2, "none", False, 6), 1),
    (Layout(1, 2, 8, 2, "gpipe", 2, "none", False, 1), 1),
    (Layout(1, 2, 8, 2, "1f1b", 4, "none", False, 1), 1),
], ids=["interleaved-v6.m2-rank0", "interleaved-v6.m2-rank1", "gpipe.m2-rank1",
        "1f1b.m4-rank1"])
def test_zero2_buffers_are_counted_from_the_first_backward(lay, pp_rank):
    """ZeRO-2/3 make a bucket's full-size accumulation buffer as the first backward's
    gradients land in it (``GradBuckets._ensure_buffer``) and free it once the last one's
    reduce-scatter is done: under GPipe, or interleaved with few micro-batches, the
    activation peak comes before any. Counted at every moment, the planner read +34.5% (rank
    0) and +13.5% (rank 1) at gpt2-medium tp1.pp2.dp8.zero2.interleaved-1f1bv6.m2 (the
    planner's pick on 16 H100s) and +24.4% under GPipe; 1F1B (a backward before the peak)
    stays as it was."""
    v = verify(preset("gpt2-medium").with_(global_batch=32), lay, dtype="bfloat16",
               profile="h100", pp_rank=pp_rank)
    assert abs(v.error) < 0.05, v.report()


def test_zero_bubble_keeps_full_sequence_rows_for_w_under_sequence_parallelism():
    """W's weight GEMMs read the all-gathered input (column-parallel) and the all-gathered
    output gradient (row-parallel): what zb-h1 keeps from B to W does not shrink under
    sequence parallelism (the planner counted the row-parallel layers' and the head's
    sequence shards: -1.7% at gpt2-medium tp4.pp2.sp rank 1 against +2.2% without sp)."""
    from distllm.plan import CostModel, load_profile

    cm = CostModel(preset("gpt2-medium").with_(global_batch=16), load_profile("a100-80gb"), 8,
                   8)
    for tp in (2, 4):
        lays = [Layout(tp, 2, 1, 0, "zb-h1", 8, "none", sp, 1) for sp in (False, True)]
        assert cm._deferred_bytes(lays[0], 1) == cm._deferred_bytes(lays[1], 1)


def test_interleaved_sequence_parallel_dry_run_agrees_with_the_planner():
    """GPT-3 175B's pick (tp8.pp4, interleaved, sequence parallelism) in miniature: tp=4,
    pp=4, two chunks per rank, 16 micro-batches, 8 blocks, so that rank 1 holds a 2-block
    and a 1-block chunk. Its peak needs every term the planner missed there: the QKV and MLP
    GEMMs' all-gathered inputs (-18% without them), the chunks' own sizes (-13% with an even
    split), the messages kept until the step's end (-9% without them) and, on the dry run's
    side, CUDA's layer norm (+8% with the CPU's fp32 copies)."""
    shape = ModelShape("custom", 8, 128, 8, 512, 256, 256, 16)
    lay = Layout(4, 4, 1, 0, "interleaved-1f1b", 16, "none", True, 2)
    v = verify(shape, lay, pp_rank=1)
    assert abs(v.error) < 0.03, v.report()


def test_an_interleaved_rank_keeps_one_output_per_chunk_and_micro_batch_in_flight():
    """The executor keeps each non-last chunk's output for every micro-batch that chunk holds
    (``_StepRun.outputs``, keyed by micro-batch and chunk) until its backward. The planner
    counted a v-th of one per chunk held: rank 0 of an interleaved pp2 (v = 2) read 2.5
    messages below the 1F1B layout with the same blocks on that rank. With the schedule the
    only difference, the planner's error is the same for both."""
    shape = ModelShape("custom", 8, 256, 4, 1024, 256, 128, 8, tied_embeddings=False)
    msg = 4 * 2 * 128 * 256  # one micro-batch's residual stream in fp32
    gaps = {}
    for sched, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        lay = Layout(1, 2, 1, 0, sched, 4, "full", False, v)
        res = verify(shape, lay, dtype="float32", profile="cpu", pp_rank=0)
        gaps[sched] = res.measured.peak - res.predicted["total"]
    assert abs(gaps["interleaved-1f1b"] - gaps["1f1b"]) < msg / 4, (gaps, msg)


def test_dry_run_takes_the_code_path_of_its_device():
    """On the CPU a 16-bit layer norm computes in fp32 and keeps an fp32 copy of its input
    for backward (``distllm.nn.precision``); on CUDA it keeps the 16-bit input. A dry run
    for a GPU counts the latter: 2 bytes less per element of each norm's input (two per
    block and the head's)."""
    shape = preset("tiny").with_(global_batch=2, seq_len=64)
    lay = Layout(1, 1, 1, 0, "none", 1, "none", False, 1)
    from distllm.plan.verify import gpt_config_for

    mcfg = gpt_config_for(shape)
    cfg = train_config_for(lay, shape, "bfloat16")
    cpu, cuda = (dry_run(cfg, mcfg, 1, device=d) for d in ("cpu", "cuda"))
    assert cpu.states == cuda.states
    norms = 2 * mcfg.n_layers + 1
    saved = cpu.phases["forward-backward"] - cuda.phases["forward-backward"]
    assert saved >= 2 * norms * 2 * 64 * mcfg.hidden_size
    with pytest.raises(ValueError, match="device='tpu'"):
        dry_run(cfg, mcfg, 1, device="tpu")


def test_dry_run_counts_the_states_of_a_small_engine():
    """tiny GPT, float32 DDP on 2 fake ranks: parameters, gradient buckets (views) and
    AdamW moments are exactly 4 + 4 + 8 bytes per parameter; the optimizer step's peak is
    those states alone (fused AdamW updates in place, no temporary); nothing leaks out of
    the run."""
    shape = preset("tiny").with_(global_batch=2, seq_len=64)
    lay = Layout(1, 1, 2, 0, "none", 1, "none", False, 1)
    from distllm.plan.verify import gpt_config_for

    mcfg = gpt_config_for(shape)
    res = dry_run(train_config_for(lay, shape, "float32"), mcfg, 2)
    n = mcfg.num_params() + (mcfg.padded_vocab(1) - mcfg.vocab_size) * mcfg.hidden_size * 2
    # AdamW's step count is one fp32 scalar per parameter tensor: embedding (token,
    # position), 12 per block (two norms, four linears, weight and bias), head (norm, matrix)
    tensors = 2 + 12 * mcfg.n_layers + 3
    assert res.states == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * tensors}
    assert res.phases["optimizer"] == pytest.approx(16 * n, rel=0.02)
    assert res.phases["forward-backward"] > 16 * n
    assert not dist.is_initialized()
    assert "data_ptr" not in vars(FakeTensor)
    assert torch.nn.Module.to.__module__ == "torch.nn.modules.module"


def test_cli_verify(capsys):
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "a100-80gb", "--tp", "1",
            "--pp", "2", "--dp", "2", "--zero", "1", "--micro-batches", "2", "--schedule",
            "1f1b", "--checkpointing", "none", "--global-batch", "4", "--seq-len", "64",
            "--verify"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "tp1.pp2.dp2.zero1.1f1b.m2" and out["world"] == 4
    assert abs(out["error"]) < TOLERANCE, out
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("verify tp1.pp2.dp2.zero1.1f1b.m2 of tiny") and "error" in text


def test_fake_data_pointers_stay_unique_after_storages_die():
    """The gradient buckets take a gradient whose ``data_ptr`` is its bucket slice's for one
    autograd accumulated in place, and keep it: a pointer that a new storage shares with a
    live one kept every attention projection's gradient of gpt2-xl alive in the dry run
    (246 MB at dp8 ZeRO-2)."""
    import gc

    from distllm.plan.dry_run import _Counter, _patched

    counter = _Counter()
    header = (torch.Size([1, 1, 1]), torch.float32)
    with _patched(header, counter), FakeTensorMode(), counter:
        ts = [torch.empty(8) for _ in range(3)]
        ptrs = [t.data_ptr() for t in ts]
        assert len(set(ptrs)) == 3
        del ts[0]
        gc.collect()
        new = torch.empty(8)
        assert new.data_ptr() not in {t.data_ptr() for t in ts}
        assert ts[1][2:].data_ptr() == ts[1].data_ptr() + 8  # offsets still count


def test_cli_verify_sequence_parallel(capsys):
    """Under sequence parallelism the norms are ``ParallelLayerNorm``s, built in the
    training dtype on the fake tensors like every other layer."""
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "a100-80gb", "--tp", "2",
            "--pp", "1", "--dp", "2", "--zero", "1", "--micro-batches", "1", "--checkpointing",
            "none", "--global-batch", "2", "--seq-len", "64", "--sequence-parallel", "on",
            "--verify", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "tp2.pp1.dp2.zero1.m1.sp" and out["fits"], out
    assert abs(out["error"]) < TOLERANCE, out


def test_cli_verify_fails_when_the_dry_run_does_not_fit(monkeypatch, capsys):
    """A ranked layout whose measured peak is over the profile's usable memory fails the
    verification: the verdict names the layout and both sizes, exit code 1."""
    import dataclasses

    import distllm.plan.verify as verify_mod
    from distllm.plan import load_profile

    a100 = load_profile("a100-80gb")
    small = dataclasses.replace(a100, memory_bytes=1e6, usable_memory_fraction=0.9)
    monkeypatch.setattr(verify_mod, "load_profile", lambda _name: small)
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--gpu", "a100-80gb", "--tp", "1",
            "--pp", "1", "--dp", "2", "--zero", "0", "--micro-batches", "1", "--checkpointing",
            "none", "--global-batch", "2", "--seq-len", "64", "--verify"]
    assert main(argv) == 1
    cap = capsys.readouterr()
    verdict = cap.out.splitlines()[-1].strip()
    assert verdict.startswith("does not fit: tp1.pp1.dp2.zero0.m1 measured a peak of "), verdict
    assert "over the 0.0009 GB usable on a100-80gb" in verdict, verdict
    assert cap.err == f"distllm plan: verify failed: {verdict}\n"
    assert main([*argv, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["usable_gb"] == pytest.approx(0.0009)
    assert out["measured_gb"]["total"] > out["usable_gb"]


def test_a_shape_given_by_flags_is_the_gpt_distllm_trains_and_verify_checks_its_estimate(
        capsys):
    """A model given by shape flags is planned as distllm's GPT (untied head), as the preset
    of the same shape is; and ``--verify`` dry-runs the model whose estimate decided: a
    tied shape at pp 1 (gpt-1.7b) is built tied (it had been built untied, its estimate
    checked in place of the search's)."""
    pins = ["--gpus", "8", "--gpu", "a100-80gb", "--tp", "1", "--pp", "1", "--zero", "0",
            "--micro-batches", "1", "--checkpointing", "none", "--global-batch", "8",
            "--seq-len", "64", "--json"]

    def planned(*argv):
        assert main(["plan", *argv, *pins]) == 0
        return json.loads(capsys.readouterr().out)

    flags = ["--layers", "12", "--hidden", "768", "--heads", "12", "--ffn", "3072", "--vocab",
             "50257"]
    by_flags, by_name = planned(*flags), planned("--model", "gpt2-small")
    first = [rows["ranked"][0]["memory_gb"] for rows in (by_flags, by_name)]
    assert first[0] == first[1], first
    tied = preset("gpt-1.7b").with_(layers=2, global_batch=8, seq_len=64)
    assert tied.tied_embeddings
    v = verify(tied, Layout(1, 1, 2, 0, "none", 1, "none", False, 1), profile="a100-80gb")
    from distllm.plan.cost import CostModel
    from distllm.plan.hardware import load_profile

    cm = CostModel(tied.with_(dropout=False), load_profile("a100-80gb"), 2, 2,
                   dtype="bfloat16", flash_attention=True)
    assert v.predicted == cm.rank_memory(Layout(1, 1, 2, 0, "none", 1, "none", False, 1), 0)
    assert abs(v.error) < TOLERANCE, v.error
