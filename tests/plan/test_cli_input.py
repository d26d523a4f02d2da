"""``distllm plan`` input: every bad value is one line naming its flag, exit code 2; layouts
the trainer refuses are rejected; ``--calibrate``'s rank count; the device detection behind
``distllm train --plan auto`` (no processes, no GPU: the device is only named)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types

import pytest
import torch

from distllm.cli import main
from distllm.plan import detect_profile, load_profile, preset, search

GiB = 2**30


@pytest.mark.parametrize(
    "argv,err",
    [
        (["--params", "7e9", "--gpus", "0"], "gpus=0: give --gpus as a positive integer"),
        (["--params", "7e9", "--gpus", "-8"], "gpus=-8: give --gpus as a positive integer"),
        (["--params", "7e9", "--tp", "-1"], "--tp=-1: it must be a positive integer"),
        (["--params", "7e9", "--tp", "0"], "--tp=0: it must be a positive integer"),
        (["--params", "7e9", "--pp", "0"], "--pp=0: it must be a positive integer"),
        (["--model", "tiny", "--kv-heads", "-1"],
         "kv_heads=-1: set --kv-heads to 0 (= heads) or a positive count"),
        (
            ["--model", "tiny", "--gpus", "8", "--tp", "3"],
            "--tp 3 does not divide --gpus 8: choose --tp from 1, 2, 4, 8",
        ),
        (
            ["--model", "tiny", "--gpus", "8", "--dp", "3"],
            "--dp 3 does not divide --gpus 8: choose --dp from 1, 2, 4, 8",
        ),
        (
            ["--model", "tiny", "--gpus", "8", "--pp", "16"],
            "--pp 16 does not divide --gpus 8: choose --pp from 1, 2, 4, 8",
        ),
        (
            ["--model", "tiny", "--gpus", "8", "--tp", "4", "--pp", "4"],
            "--tp 4 x --pp 4 = 16 does not divide --gpus 8: change one of them",
        ),
        (
            ["--model", "tiny", "--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "1"],
            "--tp 2 x --pp 2 x --dp 1 = 4 is not --gpus 8: drop --dp or make tp*pp*dp = gpus",
        ),
    ],
)
def test_bad_cluster_or_pin_names_the_flag(argv, err, capsys):
    assert main(["plan", *argv]) == 2
    assert capsys.readouterr().err == f"distllm plan: error: {err}\n"


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--verify"], "--verify"),
        (["--model", "gpt3-175b"], "--model"),
        (["--runtime", "nope"], "--runtime"),
        (["--gpus-per-node", "3"], "--gpus-per-node"),
        (["--layers", "4", "--schedule", "1f1b", "--top", "2"], "--layers --schedule --top"),
    ],
)
def test_params_table_refuses_the_flags_it_does_not_read(extra, named, capsys):
    """A ``--params`` table has no shape and runs no search: a flag of either was ignored,
    an invalid one too, with exit code 0."""
    assert main(["plan", "--params", "1e9", "--gpus", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distllm plan: error: --params gives the model-state table of a "
                          f"bare parameter count (no shape, no search), which does not read "
                          f"{named}: drop "), err
    assert err.count("\n") == 1
    # what it reads is taken
    assert main(["plan", "--params", "1e9", "--gpus", "8", "--tp", "2", "--zero", "1",
                 "--dtype", "float32", "--json", "--explain"]) == 0


def test_a_missing_profile_file_is_named_as_such(capsys, tmp_path):
    """``--gpu PATH.json`` that does not exist: not an "unknown hardware profile"."""
    path = tmp_path / "mine.json"
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpu", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distllm plan: error: --gpu {path}: no such file; give the path "
                          "of a profile .json (distllm plan --calibrate writes one)"), err


def test_pinned_sequence_parallelism_needs_seq_len_divisible_by_tp(capsys):
    from distllm.train.config import ParallelConfig, TrainConfig, check_layout

    why = "sequence parallelism needs --seq-len 33 divisible by --tp 2: change --seq-len"
    argv = [
        "plan",
        "--model",
        "tiny",
        "--gpus",
        "2",
        "--gpu",
        "cpu",
        "--tp",
        "2",
        "--seq-len",
        "33",
        "--sequence-parallel",
        "on",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    pins = {"tp": 2, "sequence_parallel": True}
    res = search(preset("tiny").with_(seq_len=33), 2, profile="cpu", pins=pins)
    assert not res.ranked and {e.rejected_reason for e in res.rejected} == {why}
    res = search(preset("tiny").with_(seq_len=34), 2, profile="cpu", pins=pins)
    assert res.ranked and all(e.layout.sequence_parallel for e in res.ranked)
    # the trainer agrees: 33 refused, 34 taken
    cfg = TrainConfig(model="tiny", parallel=ParallelConfig(tp=2, sequence_parallel=True))
    shape = {"n_layers": 4, "n_heads": 4, "hidden": 128}
    check_layout(cfg, 2, seq_len=34, **shape)
    with pytest.raises(ValueError, match="--seq-len 33 is not divisible by --tp 2"):
        check_layout(cfg, 2, seq_len=33, **shape)


def test_seq_len_beyond_the_presets_positions_is_refused_as_the_trainer_does(capsys):
    """A learned position table has one row per position: gpt2-small (1024) does not plan
    4096, in the trainer's words; its own 1024 plans, and a rotary model is not bounded."""
    from distllm.train.cli import precheck
    from distllm.train.config import TrainConfig

    why = "--seq-len 4096 exceeds the gpt2-small context 1024: lower --seq-len"
    assert main(["plan", "--model", "gpt2-small", "--seq-len", "4096"]) == 2
    assert capsys.readouterr().err == f"distllm plan: error: {why}\n"
    with pytest.raises(ValueError) as e:
        precheck(TrainConfig(model="gpt2-small", seq_len=4096), 1)
    assert str(e.value) == why
    assert main(["plan", "--model", "gpt2-small", "--seq-len", "1024", "--top", "1"]) == 0
    argv = ["plan", "--model", "llama2-7b", "--seq-len", "8192", "--gpus", "64", "--top", "1"]
    assert main(argv) == 0
    capsys.readouterr()


@pytest.mark.parametrize("dtype", ["float16", "fp16", "half"])
def test_float16_is_refused_for_the_distllm_runtime_only(dtype, capsys):
    """distllm trains in float32, bfloat16 and float64 (no float16); Megatron-LM 2021 trained
    in fp16, so that runtime plans it."""
    argv = ["plan", "--model", "gpt2-small", "--gpus", "8", "--dtype", dtype, "--top", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "distllm plan: error: dtype='float16': the distllm runtime does not train in float16: "
        "choose --dtype from float32, bfloat16, float64, or another --runtime\n"
    )
    assert main([*argv, "--runtime", "megatron-lm-2021"]) == 0
    assert "top 1 of" in capsys.readouterr().out


def test_a_bad_profile_file_is_named_with_the_flag(tmp_path, capsys):
    bad = tmp_path / "mine.json"
    for text, why in (
        ("not json", "Expecting value: line 1 column 1 (char 0)"),
        ('{"name": "x"}', "profile is missing the field 'links'"),
    ):
        bad.write_text(text)
        assert main(["plan", "--model", "tiny", "--gpu", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err == f"distllm plan: error: --gpu {bad} is not a valid profile: {why}\n"


@pytest.mark.parametrize("argv,ranks", [([], 4), (["--gpus", "2"], 2)])
def test_calibrate_measures_4_ranks_unless_told(monkeypatch, tmp_path, capsys, argv, ranks):
    asked = _fake_calibration(monkeypatch)
    out = tmp_path / "my-machine.json"
    assert main(["plan", "--calibrate", "--out", str(out), *argv]) == 0
    assert asked == [ranks] and json.loads(out.read_text())["gpus_per_node"] == ranks
    assert main(["plan", "--calibrate", "--out", str(out), "--gpus", "0"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: --gpus=0: give --calibrate a positive rank count (default 4)\n"
    )
    from distllm.train.launch import cores

    many = 4 * cores() + 1  # (--gpus is a cluster's device count everywhere else in plan)
    assert main(["plan", "--calibrate", "--out", str(out), "--gpus", str(many)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: --gpus={many}: --calibrate runs that many ranks on this machine, which has "
        f"{cores()} cores; choose 1..{many - 1} (default 4)\n")
    assert asked == [ranks]  # neither started a rank
    # a search and a --params table keep their 8 devices
    assert main(["plan", "--params", "7.5e9", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tp"], r["pp"], r["dp"]) for r in rows] == [(1, 1, 8)] * 4, rows


def _fake_calibration(monkeypatch) -> list[int]:
    """``calibrate`` replaced by the packaged cpu profile at the asked rank count (no
    measuring); returns the rank counts it was asked for."""
    import distllm.plan.calibrate as cal

    asked: list[int] = []

    def fake(net_rate, ranks):
        asked.append(ranks)
        return dataclasses.replace(load_profile("cpu"), gpus_per_node=ranks)

    monkeypatch.setattr(cal, "calibrate", fake)
    return asked


def test_calibrate_writes_to_this_folder_by_default(monkeypatch, tmp_path, capsys):
    """Without --out the profile goes to ./cpu-calibrated.json, not over the packaged cpu
    profile; --gpu reads it back."""
    from distllm.plan.hardware import PROFILE_DIR

    packaged = (PROFILE_DIR / "cpu.json").read_bytes()
    asked = _fake_calibration(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--calibrate", "--gpus", "2"]) == 0
    assert asked == [2] and (PROFILE_DIR / "cpu.json").read_bytes() == packaged
    assert [f.name for f in tmp_path.iterdir()] == ["cpu-calibrated.json"]  # no temporary
    out = capsys.readouterr().out
    assert "plan with it: distllm plan --gpu cpu-calibrated.json --gpus 2" in out, out
    assert main(["plan", "--model", "tiny", "--gpu", "cpu-calibrated.json", "--gpus", "2"]) == 0


def test_calibrate_refuses_an_out_it_cannot_or_must_not_write(monkeypatch, tmp_path, capsys):
    """A path among the packaged profiles (an existing one or a new one), a name without
    .json, a folder, a missing folder: one line naming --out, before any measuring."""
    from distllm.plan.hardware import PROFILE_DIR

    packaged = {f.name: f.read_bytes() for f in PROFILE_DIR.iterdir()}
    asked = _fake_calibration(monkeypatch)
    (tmp_path / "d.json").mkdir()
    for out, why in (
        (PROFILE_DIR / "cpu.json", "is in the profiles that ship with distllm"),
        (PROFILE_DIR / "mine.json", "is in the profiles that ship with distllm"),
        (tmp_path / "mine", "give a .json name"),
        (tmp_path / "d.json", "is a folder"),
        (tmp_path / "no" / "x.json", f"the folder {tmp_path / 'no'} does not exist"),
    ):
        assert main(["plan", "--calibrate", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"distllm plan: error: --out {out}") and why in err, err
        assert err.count("\n") == 1, err
    assert asked == []
    assert {f.name: f.read_bytes() for f in PROFILE_DIR.iterdir()} == packaged


def test_calibrate_refuses_a_bad_net_before_measuring(monkeypatch, tmp_path, capsys):
    asked = _fake_calibration(monkeypatch)
    assert main(["plan", "--calibrate", "--net", "abc", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distllm plan: error: --net 'abc': ") and err.count("\n") == 1, err
    assert err.count("--net") == 1, err  # named once
    assert asked == [] and not (tmp_path / "p.json").exists()


def test_calibrate_refuses_an_out_folder_it_cannot_write(monkeypatch, tmp_path, capsys):
    """Before measuring where the folder is not writable; after it, a write that fails (the
    folder filled or made read-only meanwhile) is one line naming --out, not a traceback."""
    from distllm.plan import calibrate

    asked = _fake_calibration(monkeypatch)
    out = tmp_path / "p.json"
    with monkeypatch.context() as m:
        m.setattr(calibrate.os, "access", lambda *a, **k: False)
        assert main(["plan", "--calibrate", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distllm plan: error: --out {out}: the folder {tmp_path} is not "
                          f"writable") and err.count("\n") == 1, err
    assert asked == []

    def full(prof, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibrate, "write_profile", full)
    assert main(["plan", "--calibrate", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distllm plan: error: --out {out}: the profile could not be "
                          f"written (No space left on device)") and err.count("\n") == 1, err


def test_an_interrupted_profile_write_leaves_the_old_file(monkeypatch, tmp_path):
    """The profile is written to a temporary file renamed over --out when complete: an
    interrupted write keeps the earlier file and leaves nothing behind."""
    import os

    from distllm.plan.calibrate import write_profile

    out = tmp_path / "mine.json"
    out.write_text("old")

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)  # Ctrl-C once the profile is written
    with pytest.raises(KeyboardInterrupt):
        write_profile(load_profile("cpu"), out)
    assert out.read_text() == "old" and [f.name for f in tmp_path.iterdir()] == ["mine.json"]
    monkeypatch.undo()
    write_profile(load_profile("cpu"), out)
    assert load_profile(str(out)) == load_profile("cpu")
    plain = tmp_path / "plain.json"
    plain.write_text("")  # the permissions open() gives a new file
    assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


@pytest.fixture
def gpu_named(monkeypatch):
    """Name device 0 (and give its memory in bytes, or leave the driver unreachable)."""

    def name(n: str, total: float | None = None) -> None:
        def props(*a):
            if total is None:
                raise RuntimeError("no NVIDIA driver")
            return types.SimpleNamespace(total_memory=int(total))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a machine of 8 of them
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties", props)

    return name


@pytest.mark.parametrize(
    "name,total,profile",
    [
        # the driver reports a little under the datasheet's GiB
        ("NVIDIA A100-SXM4-80GB", 79.2 * GiB, "a100-80gb"),
        ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"),  # no driver: the name's size
        ("NVIDIA H100 80GB HBM3", 79.1 * GiB, "h100"),
        ("NVIDIA H200", 139.8 * GiB, "h200"),
        ("NVIDIA H200", None, "h200"),  # no size anywhere: the name alone
    ],
)
def test_a_known_gpu_of_the_profiles_memory_gets_its_profile(gpu_named, name, total, profile):
    gpu_named(name, total)
    assert detect_profile() == profile


KNOWN = "packaged: a100-80gb, cpu, h100, h200"


@pytest.mark.parametrize(
    "name,total,why",
    [
        ("NVIDIA A100-SXM4-40GB", None, f"with 40 GiB (the a100-80gb profile has 80 GiB; {KNOWN})"),
        ("NVIDIA L40S", 44.4 * GiB, f"({KNOWN})"),
        # the same chips as PCIe or NVL cards, of the SXM module's memory: not its profile
        ("NVIDIA H100 PCIe", 79.6 * GiB, f"(the h100 profile is the SXM module: its compute, "
         f"memory bandwidth and NVLink are not this card's; {KNOWN})"),
        ("NVIDIA A100 80GB PCIe", 79.2 * GiB, "(the a100-80gb profile is the SXM module: its "
         f"compute, memory bandwidth and NVLink are not this card's; {KNOWN})"),
        ("NVIDIA A100-PCIE-40GB", 39.4 * GiB, "(the a100-80gb profile is the SXM module: its "
         f"compute, memory bandwidth and NVLink are not this card's; {KNOWN})"),
        ("NVIDIA H100 NVL", 93.1 * GiB, f"(the h100 profile is the SXM module: its compute, "
         f"memory bandwidth and NVLink are not this card's; {KNOWN})"),
        ("NVIDIA H200 NVL", 139.8 * GiB, f"(the h200 profile is the SXM module: its compute, "
         f"memory bandwidth and NVLink are not this card's; {KNOWN})"),
    ],
)
def test_another_gpu_says_how_to_plan_for_it(gpu_named, monkeypatch, capsys, name, total, why):
    from distllm.train import cli as train_cli

    def launch(*a):
        raise AssertionError("no layout should have been chosen")

    monkeypatch.setattr(train_cli, "launch", launch)
    gpu_named(name, total)
    with pytest.raises(ValueError) as e:
        detect_profile()
    msg = str(e.value)
    assert msg.startswith(
        f"no hardware profile for {name!r} {why}, so `distllm train --plan "
        "auto` cannot plan for it: "
    ), msg
    assert "`distllm plan --gpu FILE.json --gpus N`" in msg and msg.endswith(
        "instead of --plan auto"
    )
    # the layout flags it names are `distllm train`'s
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    named = re.search(r"\((--[^)]*)\) instead", msg).group(1).split()
    assert len(named) == 9 and set(named) <= set(p._option_string_actions), named
    # and `distllm train --plan auto` stops there, with that one line
    assert main(["train", "--plan", "auto", "--nproc", "2", "--steps", "1", "--no-save"]) == 2
    assert capsys.readouterr().err == f"distllm train: error: {msg}\n"


def test_a_reader_that_goes_away_ends_plan_quietly():
    """`distllm plan ... | head -1`: the pipe closes under plan's output; it ends as a tool
    killed by SIGPIPE does (141), without a traceback."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "distllm", "plan", "--model", "tiny", "--gpus",
                          "8", "--explain"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before it writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def _edited(path, edit) -> str:
    """The packaged a100-80gb profile, edited, written to ``path``."""
    d = json.loads((load_profile.__globals__["PROFILE_DIR"] / "a100-80gb.json").read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return str(path)


def _set(*keys, to):
    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = to
    return edit


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda d: d.clear() or d.update(x=1), "profile is missing the field 'links'"),
        (_set("links", to=[]), "field 'links' is a JSON list: give an object"),
        (_set("links", "intra", to=[1]), "field 'links.intra' is a JSON list: give an object"),
        (_set("peak_flops", to="x"), "field 'peak_flops' is a JSON str: give an object"),
        (_set("peak_flops", "bfloat16", to="3e14"),
         "field 'peak_flops.bfloat16' is '3e14': give a positive number"),
        (_set("peak_flops", "bfloat16", to=0),
         "field 'peak_flops.bfloat16' is 0: give a positive number"),
        (_set("gpus_per_node", to="8"), "field 'gpus_per_node' is '8': give an integer >= 1"),
        (_set("gpus_per_node", to=0), "field 'gpus_per_node' is 0: give an integer >= 1"),
        (_set("links", "inter", "bandwidth", to=0),
         "field 'links.inter.bandwidth' is 0: give a positive number"),
        (_set("links", "intra", "efficiency", to=0),
         "field 'links.intra.efficiency' is 0: give a number in (0, 1]"),
        (_set("gemm", "sms", to=0), "field 'gemm.sms' is 0: give an integer >= 1"),
        (_set("memory_bytes", to=0), "field 'memory_bytes' is 0: give a positive number"),
        (_set("memory_bytes", to=True), "field 'memory_bytes' is True: give a positive number"),
        (_set("usable_memory_fraction", to=1.5),
         "field 'usable_memory_fraction' is 1.5: give a number in (0, 1]"),
        (_set("cores", to=0), "field 'cores' is 0: give an integer >= 1"),
        (lambda d: d["links"]["intra"].pop("latency"),
         "profile is missing the field 'links.intra.latency'"),
        (lambda d: d["gemm"].pop("max_efficiency"),
         "profile is missing the field 'gemm.max_efficiency'"),
        (_set("links", "intra", "speed", to=1),
         "field 'links.intra.speed' is not a profile field: choose from bandwidth, latency, "
         "efficiency, overlap, uses_cpu, tree, cpu_latency, cpu_per_byte, source"),
    ],
)
def test_a_malformed_profile_is_one_line_naming_the_field(tmp_path, capsys, edit, why):
    """Valid JSON that is not a valid profile (a list, a string for a number, a zero
    bandwidth, efficiency, peak, SM count or memory): exit 2 naming the file and the field,
    not a traceback, nor a search that divides by zero or blames --gpus-per-node."""
    path = _edited(tmp_path / "mine.json", edit)
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpu", path]) == 2
    assert capsys.readouterr().err == (
        f"distllm plan: error: --gpu {path} is not a valid profile: {why}\n")


def test_a_profile_that_is_not_an_object_is_named(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert main(["plan", "--model", "tiny", "--gpu", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"distllm plan: error: --gpu {path} is not a valid profile: the file holds a JSON list, "
        "not an object of profile fields (see distllm/plan/profiles/a100-80gb.json)\n")


@pytest.mark.parametrize("name", ["a100-80gb", "h100", "h200", "cpu"])
def test_the_packaged_profiles_pass_the_checks(name):
    prof = load_profile(name)
    from distllm.plan.hardware import Profile

    assert Profile.from_json(prof.to_json()) == prof


def test_why_nothing_fits_does_not_depend_on_json(capsys):
    """--json used to keep no rejections and say "0 rejected; nothing to search"."""
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "8"]
    assert main(argv) == 2
    plain = capsys.readouterr().err
    assert main([*argv, "--json"]) == 2
    assert capsys.readouterr().err == plain
    assert "(21864 rejected; the smallest, tp8.pp1.dp1.zero0.m1536.ckpt-full.sp, needs " in plain


@pytest.mark.parametrize("value", ["0", "-8"])
@pytest.mark.parametrize("mode", [["--model", "tiny"], ["--params", "7.5e9"]])
def test_gpus_per_node_must_be_positive(capsys, value, mode):
    assert main(["plan", *mode, "--gpus", "8", "--gpus-per-node", value]) == 2
    assert capsys.readouterr().err == (
        f"distllm plan: error: --gpus-per-node={value}: it must be a positive integer (leave it "
        "out for the profile's)\n")


def test_explain_agrees_with_the_headline(capsys):
    """The breakdown and its JSON are the headline's estimate (its pipeline replayed by the
    simulator), not the closed form's."""
    argv = ["plan", "--model", "gpt2-xl", "--gpus", "16", "--pp", "2", "--zero", "1",
            "--top", "1", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    head = re.search(r"predicted (\S+) s/step, MFU (\S+)%", out)
    step = re.search(r"step of \S+: (\S+) s \(.*pipeline replayed by the simulator\)", out)
    mfu = re.search(r"\) = (\S+)%\n", out)
    assert head and step and mfu, out
    assert step.group(1) == head.group(1) and mfu.group(1) == head.group(2)
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    best = d["ranked"][0]
    assert best["step_terms_s"]["step"] == best["step_time_s"]
    assert best["step_terms_s"]["bubble"] == best["time_s"]["bubble"]


def test_verify_takes_the_dtype_aliases_the_search_takes(capsys):
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--pp", "2", "--micro-batches", "2",
            "--zero", "0", "--schedule", "1f1b", "--checkpointing", "none", "--dtype", "bf16",
            "--gpu", "a100-80gb", "--verify", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_calibrate_measures_the_links_with_the_ranks_asked(monkeypatch):
    """--calibrate --gpus N: the links with N ranks in the collective (they were measured with
    4 whatever N); one rank has no ring: two."""
    import distllm.plan.calibrate as cal

    seen = []

    def link(net_rate, nranks=4, **kw):
        seen.append((net_rate, nranks))
        return load_profile("cpu").links["intra"], ""

    for name in ("measure_gemm", "measure_attention"):
        monkeypatch.setattr(cal, name, lambda *a, **k: {"peak": 1e10, "efficiency": 0.5,
                                                        "rates": {}, "ms": 1.0})
    monkeypatch.setattr(cal, "measure_memory_and_ops", lambda *a, **k: (1e10, 1e-5))
    monkeypatch.setattr(cal, "measure_gelu", lambda *a, **k: (1e-9, 1e-9))
    monkeypatch.setattr(cal, "measure_core_sharing", lambda *a, **k: 1.0)
    monkeypatch.setattr(cal, "measure_link", link)
    for ranks, want in ((2, 2), (6, 6), (1, 2)):
        seen.clear()
        prof = cal.calibrate("1gbit", ranks=ranks)
        assert seen == [(None, want), ("1gbit", want)] and prof.gpus_per_node == ranks


@pytest.mark.parametrize("flag", [["--net", "2gbit"], ["--out", "c.json"]])
def test_a_calibrate_flag_without_calibrate_is_refused(flag, capsys):
    """They were ignored (exit 0, nothing measured or written)."""
    assert main(["plan", "--model", "tiny", *flag]) == 2
    err = capsys.readouterr().err
    assert err == (f"distllm plan: error: {flag[0]} is a --calibrate flag: add --calibrate to "
                   f"measure this machine, or drop {flag[0]}\n"), err
