"""``distllm plan`` input that used to be taken silently or end in a traceback: unknown
profile keys, unreadable profile files, flags ``--calibrate`` does not read, pins that leave
nothing to pin, what a runtime does not have; and what a search offers: a TP group on a
partly used node, the CPU profile's dtype in a ``--params`` table, the names and numbers
of its rejections."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from distllm.cli import main
from distllm.plan import Layout, load_profile, preset, search
from distllm.plan.search import _too_big


def _err(capsys, argv: list[str]) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distllm plan: error: ") and err.count("\n") == 1, err
    return err[len("distllm plan: error: "):-1]


def _profile(tmp_path, **extra) -> pathlib.Path:
    d = load_profile("a100-80gb").to_json()
    d.update(extra)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    return path


# ---------------------------------------------------------------- profiles -------------
def test_an_unknown_profile_key_is_named_with_the_file(tmp_path, capsys):
    """A misspelt field (``usable_memory_fractoin``) used to be dropped, and its default
    planned with."""
    path = _profile(tmp_path, usable_memory_fractoin=0.5)
    err = _err(capsys, ["--model", "tiny", "--gpus", "8", "--gpu", str(path)])
    assert err.startswith(f"--gpu {path} is not a valid profile: field "
                          "'usable_memory_fractoin' is not a profile field: choose from name, "
                          "peak_flops, links, gemm, gelu_s_per_element, memory_bytes, "), err
    assert "usable_memory_fraction" in err


def test_an_unreadable_profile_file_is_one_line(tmp_path, capsys, monkeypatch):
    path = _profile(tmp_path)
    real = pathlib.Path.read_text

    def refuse(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    err = _err(capsys, ["--model", "tiny", "--gpus", "8", "--gpu", str(path)])
    assert err == (f"--gpu {path} could not be read (Permission denied): make it readable or "
                   "give another --gpu"), err
    folder = tmp_path / "folder.json"
    folder.mkdir()
    err = _err(capsys, ["--model", "tiny", "--gpus", "8", "--gpu", str(folder)])
    assert err == f"--gpu {folder} is a folder: give the path of a profile .json file", err


# ---------------------------------------------------------------- flags not read --------
@pytest.mark.parametrize("extra,named", [
    (["--model", "gpt3-175b", "--tp", "8", "--json"], "--model --tp --json"),
    (["--gpu", "cpu"], "--gpu"),
    (["--explain"], "--explain"),
])
def test_calibrate_refuses_the_flags_it_does_not_read(extra, named, capsys, monkeypatch,
                                                       tmp_path):
    import distllm.plan.calibrate as cal

    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("measured"))
    err = _err(capsys, ["--calibrate", "--out", str(tmp_path / "c.json"), *extra])
    assert err == (f"--calibrate measures this machine and writes a profile (it reads --gpus, "
                   f"--net and --out), which does not read {named}: drop "
                   f"{'them' if ' ' in named else 'it'}, or run the plan without --calibrate")


@pytest.mark.parametrize("argv,err", [
    (["--pp", "1", "--schedule", "zb-h1"],
     "--schedule zb-h1 orders a pipeline's micro-batches, and --pp 1 leaves pp=1: raise --pp, "
     "or drop --schedule"),
    (["--tp", "1", "--sequence-parallel", "on"],
     "--sequence-parallel on shards activations inside a TP group, and --tp 1 leaves tp=1: "
     "raise --tp, or drop --sequence-parallel"),
    (["--gpus", "1", "--schedule", "gpipe"],
     "--schedule gpipe orders a pipeline's micro-batches, and --gpus 1 leaves pp=1: raise "
     "--pp, or drop --schedule"),
    (["--tp", "2", "--dp", "2", "--schedule", "1f1b"],
     "--schedule 1f1b orders a pipeline's micro-batches, and --tp 2 x --dp 2 on --gpus 4 "
     "leaves pp=1: raise --pp, or drop --schedule"),
])
def test_a_pin_no_layout_can_use_is_refused(argv, err, capsys):
    """The trainer refuses them; the search used to plan as if they were not given."""
    argv = ["--model", "tiny", "--gpus", "4", *argv]
    assert _err(capsys, argv) == err
    # where some layout can use them, they pin those
    res = search(preset("tiny"), 4, 4, "cpu", pins={"sequence_parallel": True})
    assert any(e.layout.sequence_parallel for e in res.ranked)
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--tp", "1",
                 "--sequence-parallel", "off", "--top", "1"]) == 0


# ---------------------------------------------------------------- runtimes --------------
def test_a_runtime_is_offered_only_what_it_has(capsys):
    """Megatron-LM 2021 has no ZeRO, no sequence parallelism, no selective recomputation,
    neither GPipe nor zb-h1: the search offered them (gpt-1.7b on 32 GPUs chose
    tp1.pp1.dp32.zero3.m2)."""
    res = search(preset("gpt-1.7b"), 32, 8, "a100-80gb", runtime_name="megatron-lm-2021")
    lays = [e.layout for e in res.ranked + res.rejected]
    assert res.ranked and res.best.layout.zero == 0
    assert {lay.zero for lay in lays} == {0}
    assert not any(lay.sequence_parallel for lay in lays)
    assert {lay.checkpointing for lay in lays} == {"none", "full"}
    # (a layout rejected before its schedule was chosen has none)
    assert {lay.schedule for lay in lays if lay.pp > 1} == {"1f1b", "interleaved-1f1b", "none"}
    ours = search(preset("gpt-1.7b"), 32, 8, "a100-80gb")
    assert {e.layout.zero for e in ours.ranked} == {0, 1, 2, 3}


@pytest.mark.parametrize("pin,err", [
    (["--zero", "3"], "--zero 3: the megatron-lm-2021 runtime does not have it: choose --zero "
                      "from 0, or another --runtime"),
    (["--sequence-parallel", "on"], "--sequence-parallel on: the megatron-lm-2021 runtime does "
                                    "not have it: choose --sequence-parallel from off, or "
                                    "another --runtime"),
    (["--checkpointing", "selective"], "--checkpointing selective: the megatron-lm-2021 runtime "
                                       "does not have it: choose --checkpointing from none, "
                                       "full, or another --runtime"),
    (["--schedule", "zb-h1"], "--schedule zb-h1: the megatron-lm-2021 runtime does not have "
                              "it: choose --schedule from 1f1b, interleaved-1f1b, or another "
                              "--runtime"),
    (["--verify"], "--verify dry-runs distllm's own training code, not the code that --runtime "
                   "megatron-lm-2021 models: drop --verify, or --runtime"),
])
def test_a_pin_the_runtime_lacks_is_refused_naming_runtime(pin, err, capsys):
    argv = ["--model", "tiny", "--gpus", "4", "--runtime", "megatron-lm-2021", *pin]
    assert _err(capsys, argv) == err


# ---------------------------------------------------------------- what is searched ------
def test_tp_needs_only_the_devices_of_a_node_in_play(capsys):
    """6 GPUs of an 8-GPU node are all on one node: tp=3 does not cross it (it was rejected
    as crossing since 8 % 3 != 0); on nodes of 6, tp=4 over 12 GPUs does."""
    argv = ["plan", "--layers", "4", "--hidden", "768", "--heads", "12", "--vocab", "1000",
            "--seq-len", "128", "--global-batch", "6", "--gpus", "6", "--gpus-per-node", "8",
            "--tp", "3", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    assert {r["tp"] for r in json.loads(capsys.readouterr().out)["ranked"]} == {3}
    shape = preset("gpt2-small").with_(global_batch=12)
    res = search(shape, 12, 6, "a100-80gb", pins={"tp": 4})
    assert not res.ranked
    assert {e.rejected_reason for e in res.rejected} == {
        "tp=4 crosses the node boundary (6 GPUs per node)"}
    assert search(shape, 12, 6, "a100-80gb", pins={"tp": 6}).ranked  # a whole node


def test_a_params_table_on_a_cpu_profile_trains_in_float32(capsys):
    """The search's default dtype on a CPU profile is float32: 4 bytes of weights per
    parameter, not bfloat16's 2."""
    argv = ["plan", "--params", "1e9", "--gpus", "4", "--gpu", "cpu"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["memory_gb"]["params"] == pytest.approx(4.0)
    assert main([*argv, "--explain"]) == 0
    assert "(float32 training): 4 weights" in capsys.readouterr().out
    assert main(["plan", "--params", "1e9", "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["memory_gb"]["params"] == pytest.approx(2.0)


def test_too_big_shows_the_overshoot():
    """``needs 78.7 GB of the 85.5 GB (78.7 GB usable)``: as many decimals as it takes."""
    prof = load_profile("a100-80gb")
    usable = prof.usable_bytes
    for over in (1e6, 1e8, 5e3):
        why = _too_big({"total": usable + over}, prof)
        need, _, cap = (float(x) for x in re.findall(r"([\d.]+) GB", why))
        assert need > cap, why
    assert _too_big({"total": 120e9}, prof) == "needs 120.0 GB of the 85.9 GB (79.0 GB usable)"


def test_a_layout_rejected_before_scheduling_has_no_schedule_in_its_name():
    assert Layout(2, 2, 2).name() == "tp2.pp2.dp2.zero0.m1"
    assert Layout(2, 2, 2, 1, "1f1b", 4).name() == "tp2.pp2.dp2.zero1.1f1b.m4"
