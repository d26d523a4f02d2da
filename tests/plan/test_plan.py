"""The planner: ZeRO paper table, Megatron activation formulas, pipeline closed forms against
the schedule replay, published layouts, search speed, CLI output and bad input."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from distllm.cli import main
from distllm.plan import CostModel, Layout, ModelShape, best_layout, load_profile, preset, search
from distllm.plan.bubble import in_flight, pipeline_time, simulator_or_none
from distllm.plan.cost import collective_time
from distllm.plan.hardware import Link
from distllm.plan.search import model_states_table

GB = 1e9


def test_zero_paper_table():
    # Rajbhandari et al. 2020 (ZeRO), Figure 1 / Table 1: Psi = 7.5B, N_d = 64, K = 12
    want = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for est in model_states_table(7.5e9, 64, profile="a100-80gb"):
        got = est.memory["total"] / GB
        assert got == pytest.approx(want[est.layout.zero], rel=0.02), est.layout
    rows = model_states_table(7.5e9, 64)
    assert rows[0].rejected_reason == "needs 120.0 GB of the 85.9 GB (79.0 GB usable)"
    assert all(r.rejected_reason is None for r in rows[1:])


def test_cli_params_json_explain(capsys):
    assert (
        main(
            [
                "plan",
                "--params",
                "7.5e9",
                "--gpus",
                "64",
                "--tp",
                "1",
                "--pp",
                "1",
                "--json",
                "--explain",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["zero"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for key in (
            "tp",
            "pp",
            "dp",
            "zero",
            "schedule",
            "micro_batches",
            "checkpointing",
            "memory_gb",
            "step_time_s",
            "mfu",
            "rejected_reason",
        ):
            assert key in r
        assert set(r["memory_gb"]) == {"params", "grads", "optimizer", "activations", "total"}
        assert (r["tp"], r["pp"], r["dp"]) == (1, 1, 64)
    assert [round(r["memory_gb"]["total"], 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    assert rows[2]["memory_gb"]["grads"] == pytest.approx(2 * 7.5 / 64, rel=1e-6)
    # --explain gives each stage its formula: bytes per parameter, divided by dp where sharded
    assert [r["explain"] for r in rows] == [
        "2P + 2P + 12P = 120.0 GB",
        "2P + 2P + 12P/64 = 31.4 GB",
        "2P + 2P/64 + 12P/64 = 16.6 GB",
        "2P/64 + 2P/64 + 12P/64 = 1.9 GB",
    ]


def test_cli_params_explain_text(capsys):
    argv = ["plan", "--params", "7.5e9", "--gpus", "64", "--tp", "2", "--pp", "1"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert "explained" not in plain  # the table alone
    # the paper's 16-bit gradients are not what distllm holds: said under the table
    assert plain.endswith("\n  (the ZeRO paper's accounting, 2-byte gradients; distllm keeps "
                          "fp32 gradients under bfloat16: 2 more bytes per parameter, sharded "
                          "as the gradients are. Give --model for distllm's own plan.)\n")
    assert main([*argv, "--explain", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model states of 7.5e+09 parameters on 64 devices")
    assert "P = 7.5e+09 parameters / (tp*pp = 2*1) = 3.75e+09 per device; dp = 32" in out
    assert "4 weights, 4 gradients, 8 AdamW momentum and variance" in out  # fp32: no master
    assert "zero2: 4P + 4P/32 + 8P/32 = 16.4 GB  fits" in out, out  # 15 + 0.47 + 0.94
    assert "activations are not counted" in out
    assert "the ZeRO paper's accounting" not in out  # fp32: the same gradient bytes
    assert main([*argv, "--json"]) == 0
    assert all("explain" not in r for r in json.loads(capsys.readouterr().out))


def test_cpu_profile_says_what_calibrate_measures():
    from distllm.plan.calibrate import OP_PROBE

    assert load_profile("cpu").source["op_overhead_s"] == OP_PROBE


def _megatron(shape: ModelShape, b: int, t: int, sp: bool, ckpt: str) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer (16-bit, dropout)."""
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    sbh = s * b * h
    if ckpt == "full":
        return 2 * sbh / (t if sp else 1)
    core = 0 if ckpt == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)


@pytest.mark.parametrize(
    "t,sp,ckpt",
    [
        (1, False, "none"),
        (8, False, "none"),
        (8, True, "none"),
        (8, True, "selective"),
        (4, False, "selective"),
        (8, False, "full"),
        (8, True, "full"),
    ],
)
def test_activations_match_megatron_formulas(t, sp, ckpt):
    """Megatron-LM keeps a column-parallel GEMM's input as its sequence shard under sequence
    parallelism (and all-gathers it again in backward): the paper's table."""
    shape = preset("gpt3-175b")  # dropout on, GPT MLP (f = 4h), no GQA
    cm = CostModel(
        shape, load_profile("a100-80gb"), 1024, 8, dtype="bfloat16", flash_attention=False,
        runtime_name="megatron-lm-2021",
    )
    for b in (1, 3):
        got = cm.layer_activation_bytes(b, t, sp, ckpt)
        assert got == pytest.approx(_megatron(shape, b, t, sp, ckpt), rel=1e-12)


@pytest.mark.parametrize("runtime, dtype, dp, m, apart", [
    ("distllm", "float32", 1, 1, True), ("distllm", "float64", 1, 1, True),
    ("distllm", "float32", 2, 1, False),  # DDP's buckets hold the gradients
    ("distllm", "float32", 1, 2, False),  # accumulated beside the next micro-batch
    ("distllm", "bfloat16", 1, 1, False),  # fp32 master gradients, held
    ("megatron-lm-2021", "float32", 1, 1, False),  # its main_grad buffer, held
])
def test_gradients_beside_activations_where_something_holds_them(runtime, dtype, dp, m, apart):
    """Where autograd's own gradients replace the activations in backward (distllm on one DP
    rank, fp32 or fp64, one micro-batch), the forward-backward peak holds the larger of the
    two; elsewhere both."""
    shape = preset("gpt2-medium").with_(global_batch=2 * dp * m, seq_len=1024)
    cm = CostModel(shape, load_profile("a100-80gb"), dp, 8, dtype=dtype, runtime_name=runtime)
    mem = cm.memory(Layout(1, 1, dp, 0, "none", m, "none", False, 1))
    act, grads = mem["activations"], mem["grads"]
    held = mem["params"] + mem["optimizer"]
    fb = held + (max(act, grads) if apart else act + grads)
    assert grads > 0 and mem["total"] == pytest.approx(max(fb, mem["optimizer_step"]), rel=1e-12)
    assert mem["total"] > mem["optimizer_step"]  # (the forward-backward peak decides here)


@pytest.mark.parametrize("t,ckpt", [(2, "none"), (8, "none"), (8, "selective"), (8, "full")])
def test_sequence_parallel_gemms_keep_their_gathered_input(t, ckpt):
    """distllm's QKV and first MLP GEMMs keep the all-gathered full-sequence input for their
    weight gradient (``_ColumnParallelMatmul``, ``fused_mlp``): the two norm outputs count
    ``2 s b h`` bytes each instead of their ``1/t`` shard; without sequence parallelism and
    under full recomputation (the block input only) nothing changes."""
    shape = preset("gpt3-175b")
    kw = dict(dtype="bfloat16", flash_attention=False)
    a100 = load_profile("a100-80gb")
    ours = CostModel(shape, a100, 1024, 8, **kw)
    paper = CostModel(shape, a100, 1024, 8, runtime_name="megatron-lm-2021", **kw)
    for b in (1, 3):
        sbh = b * shape.seq_len * shape.hidden
        extra = 0 if ckpt == "full" else 2 * 2 * sbh * (1 - 1 / t)
        got = ours.layer_activation_bytes(b, t, True, ckpt)
        assert got == pytest.approx(paper.layer_activation_bytes(b, t, True, ckpt) + extra,
                                    rel=1e-12)
        assert ours.layer_activation_bytes(b, t, False, ckpt) == pytest.approx(
            paper.layer_activation_bytes(b, t, False, ckpt), rel=1e-12)


def test_pipeline_closed_forms_against_the_schedule_replay():
    sim = simulator_or_none()
    assert sim is not None, "distllm.parallel.pipeline schedules/simulate should import"
    for p in (2, 3, 4):
        for m in (p, 2 * p, 2 * p + 1):
            for sch in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
                v = 2 if sch == "interleaved-1f1b" else 1
                if sch == "interleaved-1f1b" and m % p:
                    continue
                tf, tb, tw = [1.0] * p, [2.0] * p, [1.0] * p
                closed = pipeline_time(sch, p, m, v, tf, tb, tw, 0.0)
                replay = pipeline_time(sch, p, m, v, tf, tb, tw, 0.0, simulator=sim)
                assert closed == pytest.approx(replay, rel=0.08), (sch, p, m)
                if sch in ("gpipe", "1f1b"):  # (m + p - 1)(t_f + t_b) exactly
                    assert closed == pytest.approx((m + p - 1) * 3.0, rel=1e-12)
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 8) == [8] * 4
    assert in_flight("interleaved-1f1b", 4, 8, 2)[0] == pytest.approx(4 + 3 / 2)
    assert in_flight("zb-h1", 4, 8) == [4] * 4  # W deferred: the last rank holds p too


def test_activations_in_flight_match_the_schedule_replay():
    """The memory model's micro-batches held per rank are the replay's peak, every schedule
    (zb-h1 holds each one from F to its deferred W: up to p on every rank, not 1F1B's p - r)."""
    from distllm.parallel.pipeline.schedules import build_schedule
    from distllm.parallel.pipeline.simulate import simulate

    for sch in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        for p in (2, 3, 4, 8):
            for m in (1, 2, 3, 5, 8, 16):
                for v in (2, 3) if sch == "interleaved-1f1b" else (1,):
                    try:
                        schedule = build_schedule(sch, p, m, v)
                    except ValueError:  # e.g. interleaving with m not a multiple of p
                        continue
                    want = simulate(schedule).peak_activations
                    assert in_flight(sch, p, m, v) == pytest.approx(want), (sch, p, m, v)


def test_compute_orders_are_the_schedules():
    """The memory replay's per-rank orders are ``build_schedule``'s, every schedule (zb-h1's
    longer than ``ZB_H1_BUILT * p`` micro-batches repeat the steady state's period)."""
    from distllm.parallel.pipeline.schedules import build_schedule
    from distllm.plan.bubble import ZB_H1_BUILT, compute_order

    for sch in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        for p in (2, 3, 4, 5, 8):
            for m in sorted({1, 2, 3, 5, 8, 16, 2 * ZB_H1_BUILT * p + 1, 5 * p}):
                for v in (2, 3, 8) if sch == "interleaved-1f1b" else (1,):
                    try:
                        schedule = build_schedule(sch, p, m, v)
                    except ValueError:  # e.g. interleaving with m not a multiple of p
                        continue
                    for r in range(p):
                        want = tuple((a.kind, a.mb, a.chunk) for a in schedule.compute(r))
                        assert compute_order(sch, p, m, v, r) == want, (sch, p, m, v, r)


def test_memory_states_hold_and_send_what_the_schedule_does():
    """The replay's moments hold at most the simulator's peak of chunks, reach it, and end
    with every message of the step sent: forward outputs from every stage but the last,
    input gradients from every stage but the first."""
    from distllm.plan.bubble import memory_states

    for sch in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        for p in (2, 4):
            for m in (4, 8, 16):
                for v in (2, 8) if sch == "interleaved-1f1b" else (1,):
                    for r in range(p):
                        states = memory_states(sch, p, m, v, r)
                        # zb-h1: a micro-batch is held whole until B, its deferred part to W
                        peak = max(sum(st.held) + sum(st.deferred) for st in states)
                        assert peak == pytest.approx(in_flight(sch, p, m, v)[r] * v)
                        assert (max(sum(st.deferred) for st in states) > 0) == (sch == "zb-h1")
                        sends = sum(m * ((c * p + r < p * v - 1) + (c * p + r > 0))
                                    for c in range(v))
                        # the last backward's gradient goes after its moment
                        assert sends - 1 <= max(st.sent for st in states) <= sends


def test_an_interleaved_rank_peaks_with_its_larger_chunks():
    """GPT-3 175B at pp=4, v=8: 98 entries in 32 chunks, so rank 1's first chunk has 4 blocks
    and its other seven 3. Interleaved 1F1B runs chunk 0 of micro-batches 4-7 while chunk 7
    of 0-3 drains: at its peak the rank holds 8 of the 4-block chunks and 25 others,
    107 blocks, not the 33 / 8 of its 25 blocks (103.1) of an even split."""
    import dataclasses

    from distllm.plan.bubble import memory_states
    from distllm.plan.runtime import runtime

    shape = preset("gpt3-175b").with_(dropout=False)
    # the blocks alone: no stage outputs or messages kept
    blocks_only = dataclasses.replace(runtime("distllm"), keeps_sends=False,
                                      keeps_stage_output=False)
    cm = CostModel(shape, load_profile("a100-80gb"), 1024, 8, runtime_name=blocks_only)
    assert cm.chunks(4, 8)[1] == [(4, False, False)] + [(3, False, False)] * 7
    states = memory_states("interleaved-1f1b", 4, 16, 8, 1)
    assert max(st.held[0] * 4 + sum(st.held[1:]) * 3 for st in states) == 107
    lay = Layout(8, 4, 32, 1, "interleaved-1f1b", 16, "none", False, 8)
    per = cm.layer_activation_bytes(3, 8, False, "none")
    # and one block's backward at a time, or a message being received
    assert 107 * per < cm.rank_memory(lay, 1)["activations"] < 108 * per


def test_distllm_frees_what_a_pipeline_rank_sends_as_each_send_completes():
    """distllm's StageComm drops each activation and input gradient it sent once the send
    has completed (``test_pipeline``): a middle rank of 1F1B with full recomputation (each
    block keeps only its input, the size of one message) holds the stage outputs in flight,
    as Megatron-LM 2021 does, not the 2m - 1 messages sent before the last backward that a
    runtime keeping its sends to the end of the step holds."""
    import dataclasses

    from distllm.plan.runtime import runtime

    shape = preset("gpt3-175b").with_(dropout=False)
    a100 = load_profile("a100-80gb")
    lay = Layout(8, 4, 32, 1, "1f1b", 48, "full", False, 1)
    msg = 2 * shape.seq_len * shape.hidden  # one sequence per micro-batch, bf16
    ours = CostModel(shape, a100, 1024, 8).rank_memory(lay, 1)["activations"]
    keeping = dataclasses.replace(runtime("distllm"), keeps_sends=True)
    kept = CostModel(shape, a100, 1024, 8, runtime_name=keeping).rank_memory(lay, 1)
    # nearly all of the 2m - 1 = 95 messages sent before the last backward (90 here)
    assert kept["activations"] - ours > 1.8 * 48 * msg
    assert not runtime("distllm").keeps_sends


def test_zb_h1_layouts_the_trainer_refuses_are_rejected():
    """distllm's trainer refuses zb-h1 with ZeRO-3 and with activation checkpointing: the
    planner rejects them with that reason for its runtime, and only for a runtime that
    keeps zb-h1's W pass resident (:attr:`Runtime.zb_h1_resident`)."""
    import dataclasses

    from distllm.plan.runtime import runtime

    shape = preset("gpt2-medium").with_(global_batch=32)
    pins = {"schedule": "zb-h1", "pp": 2}
    res = search(shape, 4, 4, "a100-80gb", pins=pins)
    assert res.ranked and all(e.layout.schedule == "zb-h1" for e in res.ranked)
    assert {e.layout.zero for e in res.ranked} == {0, 1, 2}
    assert {e.layout.checkpointing for e in res.ranked} == {"none"}
    why = {e.rejected_reason for e in res.rejected}
    assert "zb-h1 with zero=3: its deferred weight gradients need the released parameters" in why
    assert any(r and r.startswith("zb-h1 with checkpointing=full") for r in why), why
    lax = dataclasses.replace(runtime("distllm"), zb_h1_resident=False)
    other = search(shape, 4, 4, "a100-80gb", pins=pins, runtime_name=lax)
    assert any(e.layout.zero == 3 for e in other.ranked)
    assert any(e.layout.checkpointing == "full" for e in other.ranked)


def test_collective_alpha_beta():
    link = Link(bandwidth=1e9, latency=1e-5)
    n, nbytes = 8, 8e8
    ring = 2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * nbytes / 1e9
    assert collective_time("all_reduce", nbytes, n, link) == pytest.approx(ring)
    assert collective_time("reduce_scatter", nbytes, n, link) == pytest.approx(ring / 2)
    small = collective_time("all_reduce", 8, 1024, link)  # latency-bound: the tree wins
    assert small == pytest.approx(2 * 10 * 1e-5 + 16 / 1e9)
    assert collective_time("all_reduce", nbytes, 1, link) == 0.0


def test_gpt3_175b_on_1024_a100():
    """Narayanan et al. 2021 (Megatron-LM, arXiv:2104.04473) Table 1: GPT-3 175B on 1024
    A100-80GB, batch 1536: tp=8 (inside the node), pp=16, interleaved schedule, no ZeRO,
    140 TFLOP/s per GPU = 45% of peak counting the recomputation's FLOPs."""
    shape = preset("gpt3-175b")
    # the bound for a 1024-device search, in this process's CPU seconds: the search
    # is single-threaded Python, and the wall clock would count the neighbours sharing the
    # cores (11.5 s of wall for 3 s of search was seen with the test suite's other processes)
    t0 = time.process_time()
    res = search(shape, 1024, 8, "a100-80gb")
    assert time.process_time() - t0 < 10.0
    assert res.best.layout.tp == 8
    # the paper's setting (no ZeRO): tp inside the node, pp across nodes, bubble-reducing schedule
    paper = search(shape, 1024, 8, "a100-80gb", pins={"zero": 0}).best.layout
    assert paper.tp == 8 and paper.pp > 1, paper
    assert paper.schedule in ("interleaved-1f1b", "zb-h1"), paper
    # its published layout and its throughput: predicted within 25% of the published 45%
    pinned = {
        "zero": 0,
        "tp": 8,
        "pp": 16,
        "schedule": "interleaved-1f1b",
        "checkpointing": "full",
        "sequence_parallel": False,
    }
    est = search(shape, 1024, 8, "a100-80gb", pins=pinned).best
    hfu = est.mfu * 4 / 3  # the paper counts the full recomputation's forward too
    assert hfu == pytest.approx(0.45, rel=0.25), hfu
    assert est.memory["total"] < 80 * GB


def test_small_model_is_data_parallel():
    # Narayanan et al. 2021 Table 1: the 1.7B model on 32 GPUs runs tp=1, pp=1 (pure DP)
    lay, why = best_layout(preset("gpt-1.7b"), 32, 8, "a100-80gb")
    assert (lay.tp, lay.pp, lay.dp) == (1, 1, 32), why
    assert "chose tp1.pp1.dp32" in why


def test_explain_lists_rejections(capsys):
    rc = main(
        [
            "plan",
            "--model",
            "gpt3-175b",
            "--gpus",
            "1024",
            "--gpu",
            "a100-80gb",
            "--pp",
            "1",
            "--zero",
            "0",
            "--top",
            "2",
            "--explain",
        ]
    )
    cap = capsys.readouterr()
    out = cap.out
    # without pipeline parallelism or ZeRO nothing fits 175B on 80 GB devices: the rejected
    # layouts are listed by reason, then the error says what to change (exit code 2)
    assert rc == 2, cap.err
    assert "no layout fits" in cap.err and "--gpus" in cap.err, cap.err
    assert "tp=16 crosses the node boundary (8 GPUs per node)" in out
    assert re_search(r"needs \d+\.\d GB of the 85.9 GB", out)


def test_explain_groups_the_rejected_layouts_by_reason(capsys):
    """A search of GPT-3 175B on 1024 GPUs rejects tens of thousands of layouts: ``--explain``
    prints one line per reason (numbers aside) with its count and the two layouts that came
    closest, not one line per layout; ``--json --explain`` still lists every one."""
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb", "--top", "3",
            "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    section = out.partition("\nrejected (")[2]
    total = int(section.split(")", 1)[0])
    counts = [int(m.group(1)) for m in re.finditer(r"^ {2}\s*(\d+)  \S", section, re.M)]
    assert total > 10000 and sum(counts) == total, (total, counts)
    assert counts == sorted(counts, reverse=True)
    assert len(section.splitlines()) <= 1 + 3 * len(counts)  # a reason and its examples
    assert "  needs # GB of the # GB (# GB usable)" in section
    assert "interleaved-1f1b needs micro_batches=# divisible by pp=#" in section  # names kept
    # the memory group's examples are the layouts closest to fitting, the closest first
    mem = re.findall(r"tot=\s*([\d.]+)  REJECTED: needs .* usable\)$", section, re.M)
    assert len(mem) == 2 and float(mem[0]) <= float(mem[1]) < 85.9
    assert main([*argv, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rejected"]) == total


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_tiny_on_this_machine_and_json(capsys):
    lay, why = best_layout("tiny", 4, 4, "cpu")
    assert lay.tp * lay.pp * lay.dp == 4 and why.startswith("chose ")
    assert (
        main(["plan", "--model", "tiny", "--gpus", "4", "--gpu", "cpu", "--json", "--top", "3"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranked"]) == 3
    times = [r["step_time_s"] for r in out["ranked"]]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert all(0 < r["mfu"] <= 1 for r in out["ranked"])


def test_memory_and_time_are_monotone():
    shape, prof = preset("llama2-7b"), load_profile("h100")
    cm = CostModel(shape, prof, 64, 8)
    base = Layout(2, 1, 32, 0, "none", 4, "none", False, 1)
    m0 = cm.memory(base)["total"]
    assert cm.memory(base._replace(zero=3))["total"] < m0
    assert (
        cm.memory(base._replace(checkpointing="full"))["activations"]
        < cm.memory(base)["activations"]
    )
    assert cm.memory(base._replace(micro_batches=8))["activations"] < cm.memory(base)["activations"]
    t_full = cm.step_time(base._replace(checkpointing="full"))[0]
    assert t_full > cm.step_time(base)[0]
    assert shape.params() == pytest.approx(6.74e9, rel=0.01)  # Llama 2 7B
    assert preset("llama2-70b").params() == pytest.approx(69.0e9, rel=0.01)
    assert preset("gpt3-175b").params() == pytest.approx(175e9, rel=0.01)


@pytest.mark.parametrize(
    "argv,knob",
    [
        (["--model", "nope"], "unknown model preset"),
        (["--model", "tiny", "--gpu", "tpu9"], "--gpu"),
        (
            ["--layers", "2", "--hidden", "100", "--heads", "7", "--vocab", "9", "--seq-len", "8"],
            "--heads",
        ),
        (["--hidden", "64"], "--layers"),
        (["--model", "gpt3-175b", "--gpus", "1024", "--tp", "16"], "tp=16 crosses the node"),
        (["--model", "tiny", "--gpus", "12", "--gpus-per-node", "8"], "--gpus-per-node"),
        (["--params", "-3"], "--params"),
        (["--model", "tiny", "--top", "0"], "--top"),
        (["--model", "tiny", "--tp", "0"], "--tp"),
        (["--model", "tiny", "--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_input_names_the_knob(argv, knob, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert knob in err and err.count("\n") == 1, err


def test_profiles_carry_sources():
    for name in ("a100-80gb", "h100", "h200", "cpu"):
        prof = load_profile(name)
        assert prof.source, name
        assert all(link.source for link in prof.links.values()), name
        assert prof.flops("bfloat16") > 0 and math.isfinite(prof.memory_bytes)
    assert load_profile("a100-80gb").flops("bf16") == 312e12


def test_alpha_beta_fit_recovers_the_link():
    from distllm.plan.calibrate import AR_SIZES, fit_alpha_beta

    alpha, beta, n = 50e-6, 1 / 1.25e8, 4
    times = {s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta for s in AR_SIZES}
    a, b = fit_alpha_beta(times, n)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)


def test_best_layout_api_for_the_trainer():
    from distllm.plan import detect_profile

    assert detect_profile() in ("cpu", "a100-80gb", "h100", "h200")
    lay, why = best_layout("tiny", 4, 4, "cpu", global_batch=8, seq_len=64, pins={"zero": 1})
    assert lay.zero == 1 and lay.dp > 1 and 8 % (lay.dp * lay.micro_batches) == 0
    assert {"tp", "pp", "dp", "zero", "schedule", "micro_batches", "checkpointing"} <= set(
        lay._fields
    )
    with pytest.raises(ValueError, match="no layout fits"):
        best_layout("gpt3-175b", 8, 8, "a100-80gb")


def test_divisors_of_a_huge_cluster_are_quick():
    """The layout space's divisors: every one, ascending, found up to the square root (a
    count of 10**12 GPUs kept the planner counting to 10**12)."""
    import time

    from distllm.plan.space import divisors

    for n in range(1, 200):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    t = time.process_time()
    big = divisors(10**12)
    assert time.process_time() - t < 5.0
    assert len(big) == 13 * 13 and big[0] == 1 and big[-1] == 10**12 and big == sorted(big)


def test_zb_h1_memory_is_the_heaviest_of_every_rank():
    """Under zb-h1 the micro-batches waiting for W pile up on the later ranks, and under
    sequence parallelism a deferred micro-batch keeps more than a held one (full-sequence
    rows): a middle rank can be the heaviest. The planner looked at the first, the first with
    the most blocks and the last only, and passed GPT-3 175B at tp8.pp16 zb-h1 m64 as 78.9 GB
    (79.0 GB usable) while its own rank 14 needed 86.5 GB."""
    shape = preset("gpt3-175b").with_(seq_len=2016)
    lay = Layout(8, 16, 8, 1, "zb-h1", 64, "none", True, 1)
    cm = CostModel(shape, load_profile("a100-80gb"), 1024, 8)
    per_rank = [cm.rank_memory(lay, r)["total"] for r in range(lay.pp)]
    heaviest = max(range(lay.pp), key=per_rank.__getitem__)
    assert heaviest not in (0, lay.pp - 1)  # (every rank holds the same blocks here)
    assert cm.memory(lay)["total"] == per_rank[heaviest]
    assert cm.heaviest_rank(lay) == heaviest


def test_a_search_does_not_keep_its_schedule_replays():
    """The replays a search caches (a GB at a large batch) are dropped when it returns: a
    training run that planned its layout (``--plan auto``) does not carry them."""
    from distllm.plan import bubble

    res = search(preset("gpt2-small"), 8, None, "a100-80gb", pins={"pp": 2},
                 keep_rejected=False)
    assert res.ranked
    assert bubble.memory_states.cache_info().currsize == 0
    assert bubble.compute_order.cache_info().currsize == 0
