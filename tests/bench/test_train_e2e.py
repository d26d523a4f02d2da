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
               for lay in ("tp2", "dp2.zero2", "pp2.1f1b")]
    assert got == [*layouts, ("tiny tp1.pp1.dp1", 1, False, "train_overhead")]
    assert [c.label for c in train_e2e.cases(BenchConfig(quick=True))][:3] == [
        "tp2 tiny", "dp2.zero2 tiny", "pp2.1f1b tiny"]
    [gpu] = train_e2e.cases(BenchConfig(device="cuda"))
    assert gpu.skip == "the CPU suite (gloo ranks)"


def test_shapes_choose_the_model():
    cases = train_e2e.cases(BenchConfig(shapes="6,768,8,64;2,256,4,32,2"))
    assert [c.label for c in cases[:4:3]] == ["tp2 6x768", "tp2 2x256"]
    assert cases[3].params["shape"] == (2, 256, 4, 32, 2)
    assert cases[0].params["shape"] == (6, 768, 8, 64, 4)  # micro-batches default 4
    cfg, name = train_e2e.model_of((6, 768, 8, 64, 4))
    assert (name, cfg.n_heads, cfg.ffn_hidden_size, cfg.vocab_size) == ("6x768", 12, 3072, 256)
    assert train_e2e.model_of((4, 128, 16, 128))[0].name == "tiny"
    with pytest.raises(ValueError, match="L,H,B,S"):
        train_e2e.cases(BenchConfig(shapes="1,2,3"))


def test_model_presets_choose_the_sizes():
    cases = train_e2e.cases(BenchConfig(extra={"model": ["tiny", "gpt2-small"]}))
    assert [c.label for c in cases[:6:3]] == ["tp2 tiny", "tp2 12x768"]
    # blocks and hidden from the preset; batch, sequence, micro-batches from its size class
    assert [c.params["shape"] for c in cases[:6:3]] == [(4, 128, 16, 128, 4), (12, 768, 8, 64, 4)]
    assert train_e2e.model_shapes("gpt2-medium, tiny", quick=True) == [
        (24, 1024, 8, 64, 4), (4, 128, 8, 64, 2)]
    assert train_e2e.model_of(cases[3].params["shape"])[0].n_heads == 12
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
    case = train_e2e.cases(BenchConfig())[1]
    prof = {"distllm": _bd(100, 1), "torch_ddp": _bd(120, 50), "torch_fsdp2_zero2": _bd(1, 1)}
    res = Result({"distllm": _st(50.0), "torch_ddp": _st(40.0),
                  "torch_fsdp2_zero2": _st(80.0)}, {"x": "ImportError: no"},
                 [{"tokens": 1000, "model": "tiny", "breakdown": prof}] * 2, "2gbit", "")
    rows = {r["variant"]: r for r in train_e2e.rows(BenchConfig(out=tmp_path), case, res)}
    ours = rows["distllm"]["extra"]
    assert ours["vs_torch"] == pytest.approx(40.0 / 50.0)
    assert ours["tokens_per_s"] == pytest.approx(1000 / 0.05)
    assert ours["best_peer"] == "torch_ddp"  # the breakdown is compared with the fastest peer
    assert ours["vs_peer"]["ops"] == [100, 120, -20] and ours["vs_peer"]["syncs"] == [1, 50, -49]
    assert "top" not in ours["breakdown"] and ours["breakdown"]["ops"] == 100
    assert rows["torch_ddp"]["extra"]["role"] == "peer"
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
