"""The end-to-end training suite's cases and its rows from synthetic timings: tokens/s and
distllm against the best torch peer per layout and model size, the per-step breakdown kept
beside the results, and the per-step overhead's share."""

from __future__ import annotations

import json

import pytest
from distllm.bench import train_e2e
from distllm.bench.harness import BenchConfig, Result

from distllm.diagnostics.timing import stats_of


def _st(ms: float):
    return stats_of([ms * 0.9, ms, ms * 1.1])


def test_cases_run_every_layout_at_both_sizes_then_the_overhead():
    got = [(c.label, c.ranks, c.networks, c.suite) for c in train_e2e.cases(BenchConfig())]
    layouts = [(f"{lay} {m}", 2, True, None) for m in ("tiny", "6x768")
               for lay in ("tp2", "dp2", "dp2.zero2", "pp2.1f1b")]
    assert got == [*layouts, ("tiny tp1.pp1.dp1", 1, False, "train_overhead")]
    assert [c.label for c in train_e2e.cases(BenchConfig(quick=True))][:4] == [
        "tp2 tiny", "dp2 tiny", "dp2.zero2 tiny", "pp2.1f1b tiny"]
    [gpu] = train_e2e.cases(BenchConfig(device="cuda"))
    assert gpu.skip == "the CPU suite (gloo ranks)"


def test_shapes_choose_the_model():
    cases = train_e2e.cases(BenchConfig(shapes="6,768,8,64;2,256,4,32,2"))
    assert [c.label for c in cases[:5:4]] == ["tp2 6x768", "tp2 2x256"]
    assert cases[len(train_e2e.LAYOUTS)].params["shape"] == (2, 256, 4, 32, 2)
    assert cases[0].params["shape"] == (6, 768, 8, 64, 4)  # micro-batches default 4
    cfg, name = train_e2e.model_of((6, 768, 8, 64, 4))
    assert (name, cfg.n_heads, cfg.ffn_hidden_size, cfg.vocab_size) == ("6x768", 12, 3072, 256)
    assert train_e2e.model_of((4, 128, 16, 128))[0].name == "tiny"
    with pytest.raises(ValueError, match="L,H,B,S"):
        train_e2e.cases(BenchConfig(shapes="1,2,3"))


@pytest.mark.parametrize(("spec", "says"), [
    ("1,192,2,16,1", "tp2 splits the model's heads over its 2 ranks, and H=192 (in "
                     "1,192,2,16,1) gives 3 heads (one per 64 channels); choose H a multiple "
                     "of 128"),
    ("2,64,4,16", "tp2 splits the model's heads over its 2 ranks, and H=64 (in 2,64,4,16) "
                  "gives 1 head (one per 64 channels); choose H a multiple of 128"),
    ("2,200,4,16", "model at H=200 (in 2,200,4,16) has 3 heads (one per 64 channels), which "
                   "do not divide H; choose H a multiple of 128"),
    ("2,128,3,16,1", "dp2 and dp2.zero2 split the global batch over their 2 ranks, and B=3 "
                     "(in 2,128,3,16,1) is odd; choose B a multiple of 2"),
    ("2,128,4,16,1", "pp2.1f1b needs at least 2 micro-batches (one per stage), not M=1 "
                     "(in 2,128,4,16,1); choose M >= 2"),
    ("6,768,8,64;2,128,6,16,4", "pp2.1f1b splits the global batch into M micro-batches, and "
                                "M=4 does not divide B=6 (in 2,128,6,16,4); choose B a "
                                "multiple of M"),
])
def test_shapes_that_a_layout_cannot_run_are_refused(spec, says):
    """A variant that builds but cannot run a shape failed inside the timing and took the
    whole case with it (tp2 at 3 heads), or failed on one rank while the other waited (pp2
    with micro-batches that do not divide the batch): refused up front, naming the value."""
    with pytest.raises(ValueError) as exc:
        train_e2e.cases(BenchConfig(shapes=spec))
    assert str(exc.value) == f"--shapes {spec!r}: train_e2e's {says}"
    # every layout runs these (one block is enough for two pipeline stages)
    assert len(train_e2e.cases(BenchConfig(shapes="1,128,2,16,2;2,130,4,16,2"))) == 9


def _first_step_fails(tmp_path):
    """The tp2 case at 3 heads, which distllm refuses to build and torch's TP peer builds
    but cannot step, on 2 ranks."""
    from distllm.bench.harness import Case, run_case

    case = Case("tp2 1x192", {"layout": "tp2", "shape": (1, 192, 2, 16, 1)}, ranks=2,
                networks=True)
    return run_case(train_e2e, BenchConfig(reps=1, out=tmp_path), case)


def test_a_variant_that_fails_its_first_step_is_a_row(tmp_path):
    rows = {r["variant"]: r for r in _first_step_fails(tmp_path)}
    assert {n: r["status"] for n, r in rows.items()} == {"distllm": "unavailable",
                                                          "torch_dtensor_tp": "unavailable"}
    assert rows["distllm"]["reason"] == ("ValueError: n_heads=3 is not divisible by tp=2: "
                                         "choose tp in [1, 3] or another n_heads")
    # (torch's own words after the error's type: they may change between its versions)
    peer = rows["torch_dtensor_tp"]["reason"]
    assert peer.startswith("its first step failed: RuntimeError: "), peer
    assert "3072" in peer, peer  # the size of the view that 3 heads cannot split in 2
    assert not (tmp_path / train_e2e.BREAKDOWN_FILE).exists()  # nothing was profiled


def test_breakdowns_are_written_whole(tmp_path, monkeypatch):
    """A run killed while adding a case's breakdowns keeps the earlier cases readable (half a
    file made every later case's rows() raise)."""
    from tests.bench.interrupted import Killed, half_writes

    earlier = {"distllm": _bd(100, 1)}
    train_e2e.write_breakdown(tmp_path, "loopback tp2 tiny b1024 tokens/step", earlier)
    half_writes(monkeypatch)
    with pytest.raises(Killed):
        train_e2e.write_breakdown(tmp_path, "loopback dp2 tiny b1024 tokens/step",
                                  {"distllm": _bd(120, 2)})
    monkeypatch.undo()
    kept = json.loads((tmp_path / train_e2e.BREAKDOWN_FILE).read_text())
    assert kept == {"loopback tp2 tiny b1024 tokens/step": earlier}
    assert [f.name for f in tmp_path.iterdir()] == [train_e2e.BREAKDOWN_FILE]


def test_model_presets_choose_the_sizes():
    cases = train_e2e.cases(BenchConfig(extra={"model": ["tiny", "gpt2-small"]}))
    assert [c.label for c in cases[::len(train_e2e.LAYOUTS)][:2]] == ["tp2 tiny", "tp2 12x768"]
    # blocks and hidden from the preset; batch, sequence, micro-batches from its size class
    firsts = cases[::len(train_e2e.LAYOUTS)][:2]  # each size's first layout
    assert [c.params["shape"] for c in firsts] == [(4, 128, 16, 128, 4), (12, 768, 8, 64, 4)]
    assert train_e2e.model_shapes("gpt2-medium, tiny", quick=True) == [
        (24, 1024, 8, 64, 4), (4, 128, 8, 64, 2)]
    assert train_e2e.model_of(cases[len(train_e2e.LAYOUTS)].params["shape"])[0].n_heads == 12
    with pytest.raises(ValueError, match=r"--model 'gpt2-small-6': unknown GPT preset.*"
                                         r"choose from tiny, gpt2-small"):
        train_e2e.cases(BenchConfig(extra={"model": "gpt2-small-6"}))
    with pytest.raises(ValueError, match="--model and --shapes"):
        train_e2e.cases(BenchConfig(shapes="6,768,8,64", extra={"model": ["tiny"]}))


def _bd(ops: int, syncs: int) -> dict:
    return {"wall_ms": 10.0, "ops": ops, "op_ms": 9.0, "outside_ms": 1.0, "collectives": 2,
            "collective_mb": 1.0, "copies": 3, "allocs": 4, "alloc_mb": 0.5, "syncs": syncs,
            "by_collective": {"allreduce_": 2}, "by_transfer_mb": {}, "top": []}


def test_layout_rows_against_the_best_peer_with_breakdowns(tmp_path):
    case = train_e2e.cases(BenchConfig())[2]
    prof = {"distllm": _bd(100, 1), "torch_ddp": _bd(120, 50), "torch_fsdp2_zero2": _bd(1, 1)}
    res = Result({"distllm": _st(50.0), "torch_ddp": _st(40.0),
                  "torch_fsdp2_zero2": _st(80.0)}, {"x": "ImportError: no"},
                 [{"tokens": 1000, "model": "tiny", "breakdown": prof,
                   "grad_reduce": "during backward: reduce-scatter mode"}] * 2, "2gbit", "")
    rows = {r["variant"]: r for r in train_e2e.rows(BenchConfig(out=tmp_path), case, res)}
    ours = rows["distllm"]["extra"]
    assert ours["vs_torch"] == pytest.approx(40.0 / 50.0)
    assert ours["tokens_per_s"] == pytest.approx(1000 / 0.05)
    assert ours["best_peer"] == "torch_ddp"  # the breakdown is compared with the fastest peer
    assert ours["vs_peer"]["ops"] == [100, 120, -20] and ours["vs_peer"]["syncs"] == [1, 50, -49]
    assert "top" not in ours["breakdown"] and ours["breakdown"]["ops"] == 100
    assert rows["torch_ddp"]["extra"]["role"] == "peer"
    assert ours["grad_reduce"] == "during backward: reduce-scatter mode"  # distllm's row only
    assert "grad_reduce" not in rows["torch_ddp"]["extra"]
    assert rows["x"]["status"] == "unavailable" and rows["x"]["reason"] == "ImportError: no"
    assert rows["distllm"]["case"] == "2gbit dp2.zero2 tiny b1000 tokens/step"
    kept = json.loads((tmp_path / train_e2e.BREAKDOWN_FILE).read_text())
    assert kept == {"2gbit dp2.zero2 tiny b1000 tokens/step": prof}


def test_overhead_row():
    case = train_e2e.cases(BenchConfig())[-1]
    res = Result({"wall": _st(100.0), "profiled": _st(130.0)}, {}, [{"op_ms": 96.0}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    assert (r["suite"], r["case"], r["ms"]) == ("train_overhead", "tiny tp1.pp1.dp1", 100.0)
    assert r["extra"]["overhead_frac"] == pytest.approx(0.04) and r["extra"]["met"] is True
    assert r["extra"]["overhead_band"] is None  # no per-round operator times: no band
    # round by round: a plain step of 100, 110, 90, 120, 80 ms against the profiled steps'
    # operators of the same rounds, 96, 99, 90, 120, 76: overheads 4%, 10%, 0, 0, 5%
    wall = stats_of([100.0, 110.0, 90.0, 120.0, 80.0])
    res = Result({"wall": wall, "profiled": _st(130.0)}, {},
                 [{"op_ms": 96.0, "op_ms_rounds": [96.0, 99.0, 90.0, 120.0, 76.0]}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    assert r["extra"]["overhead_band"] == pytest.approx((0.0, 0.08))


def test_an_overhead_above_its_step_is_not_read_and_the_verdict_says_the_figure():
    """The profiled step's operators can take longer than a plain step (the profiler slows
    them): the share was clamped to 0% and marked met. Now it is not read, and the report's
    verdict says the overhead, or why there is none (it said "distllm only")."""
    from distllm.bench.report import verdict

    case = train_e2e.cases(BenchConfig())[-1]
    res = Result({"wall": _st(64.7), "profiled": _st(200.0)}, {}, [{"op_ms": 130.1}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    assert r["extra"]["overhead_frac"] is None and r["extra"]["met"] is None
    r["status"] = "ok"
    assert verdict([r]) == ("on cpu: fixed overhead not read: the profiled step's operators "
                            "took 130 ms, more than a plain step's 64.7 ms")
    res = Result({"wall": _st(100.0), "profiled": _st(130.0)}, {}, [{"op_ms": 93.0}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    r["status"] = "ok"
    assert verdict([r]) == ("on cpu: fixed overhead 7.0% of the step outside operators, "
                            "target <= 0.05: missed (on the median: no per-round values)")


def test_overhead_counts_every_operator_namespace():
    """The oneDNN kernels that the cpu backend and torch's CPU linear call run as ``mkldnn::``
    operators: their time is inside operators, not overhead (nor are gloo's transfers);
    autograd's nodes and the Functions' Python bodies are not operators."""
    from types import SimpleNamespace as E

    class Prof:
        def key_averages(self):
            return [E(key="aten::mm", self_cpu_time_total=4000),
                    E(key="mkldnn::_linear_pointwise", self_cpu_time_total=3000),
                    E(key="distllm::gemm_dgelu", self_cpu_time_total=2000),
                    E(key="gloo:all_reduce", self_cpu_time_total=500),
                    E(key="autograd::engine::evaluate_function: MmBackward0",
                      self_cpu_time_total=700),
                    E(key="_ParallelMLPBackward", self_cpu_time_total=900)]

    assert train_e2e._op_ms(Prof()) == pytest.approx(9.5)


def _peer_clips(kind: str):
    """Gradients of 2 ranks clipped by the peer's rule, and the reference: every rank's
    gradients scaled by max_norm / global norm (the norm over both ranks' shards)."""
    import torch
    import torch.distributed as dist
    from distllm.bench import train_e2e_variants as tv
    from torch import nn

    r = dist.get_rank()
    g = torch.Generator().manual_seed(7 + r)
    params = [nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(4))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    shards = [p.grad.clone() for p in params]
    if kind == "pp":  # each stage holds its own parameters
        tv._clip_pp(params, 0.5, None)
        local = sum(float(s.double().square().sum()) for s in shards)
        sq = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(sq)
    else:  # tp: the first is sharded (a DTensor), the second replicated (plain, the same)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (2,))
        shards[1] = torch.arange(4.0)
        params[1].grad = shards[1].clone()
        params[0] = nn.Parameter(DTensor.from_local(torch.zeros(5, 3), mesh, [Shard(0)]))
        params[0].grad = DTensor.from_local(shards[0].clone(), mesh, [Shard(0)])
        tv._clip_tp(params, 0.5)
        sq = torch.tensor(float(shards[0].double().square().sum()), dtype=torch.float64)
        dist.all_reduce(sq)
        sq += float(shards[1].double().square().sum())
    coef = min(1.0, 0.5 / (float(sq) ** 0.5 + 1e-6))
    got = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for p in params]
    return [(a.flatten().tolist(), (s * coef).flatten().tolist())
            for a, s in zip(got, shards, strict=True)]


@pytest.mark.parametrize("kind", ["pp", "tp"])
def test_torch_peers_clip_by_the_global_norm(kind):
    """The peers do the work distllm's step does: clipping by the norm over all ranks'
    gradients (pipeline stages; TP shards plus the replicated parameters once)."""
    from distllm.testing import run_distributed

    for per_rank in run_distributed(_peer_clips, 2, kind, timeout=120):
        for got, want in per_rank:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_a_distllm_variant_that_did_not_build_is_one_row():
    """distllm's build error is its row; "did not build" only where no reason was given."""
    res = {"stats": {"torch_ddp": _st(40.0)}, "missing": {"distllm": "RuntimeError: boom"},
           "tokens": 1000, "model": "tiny", "breakdown": {}, "grad_reduce": None}
    rows = train_e2e._layout_rows("dp2", res, "loopback", "")
    keys = [(r["suite"], r["case"], r["variant"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2
    ours = next(r for r in rows if r["variant"] == "distllm")
    assert (ours["status"], ours["reason"]) == ("unavailable", "RuntimeError: boom")
    rows = train_e2e._layout_rows("dp2", {**res, "missing": {}}, "loopback", "")
    ours = next(r for r in rows if r["variant"] == "distllm")
    assert (ours["status"], ours["reason"], ours["extra"]["net"]) == (
        "unavailable", "did not build", "loopback")


def test_the_overhead_target_is_judged_on_its_band():
    """Overheads of 4%, 10%, 0, 0, 5% round by round (median 4%): the 5% target was "met" on
    the median while one round in five was over it."""
    from distllm.bench.report import verdict

    case = train_e2e.cases(BenchConfig())[-1]
    wall = stats_of([100.0, 110.0, 90.0, 120.0, 80.0])
    res = Result({"wall": wall, "profiled": _st(130.0)}, {},
                 [{"op_ms": 96.0, "op_ms_rounds": [96.0, 99.0, 90.0, 120.0, 76.0]}])
    [r] = train_e2e.rows(BenchConfig(), case, res)
    assert r["extra"]["met"] is True and r["extra"]["target_status"] == "within the spread"
    r["status"] = "ok"
    assert verdict([r]).endswith("target <= 0.05: within the spread"), verdict([r])
