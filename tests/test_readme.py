"""Every shell command in README.md's ```bash blocks runs as written.

Each command is checked the cheapest way that still exercises the real code:

- ``distllm train`` (alone, or under ``torchrun``): the flags go through the real parser and
  config classes, then every check ``distllm train`` makes before a rank starts, at the
  command's world size (``--nproc N``, or torchrun's ``--nnodes`` x ``--nproc-per-node``
  parsed by torchrun's own parser), the planner included for ``--plan auto``; nothing trains;
- ``distllm plan``: run for real (pure arithmetic, fast), except ``--calibrate``, which
  measures the machine: its flags are parsed only;
- ``distllm bench``: ``--list`` runs; any other is parsed and validated as ``distllm bench``
  validates it (suites, dtype, shapes, link rate), without running a suite;
- ``distllm export``: parsed only (its RUN is a training run's output);
- ``make TARGET``: ``make -n TARGET`` must succeed (the target exists in the Makefile).

Anything else fails the test: a new kind of command needs a check here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, one per line (``\\`` continuations joined,
    comments and blank lines dropped)."""
    cmds = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            if shlex.split(line, comments=True):
                cmds.append(line.strip())
    return cmds


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    """``argv`` through the real parser of ``distllm <command>`` (as distllm.cli builds it)."""
    import importlib

    from distllm.cli import COMMANDS

    modname, help_ = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"distllm {command}", description=help_)
    importlib.import_module(modname).add_arguments(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(
            f"distllm {command} rejects its flags: {err.getvalue().strip()}") from None


def _train(argv: list[str], world: int | None) -> None:
    from distllm.cli import USAGE_ERRORS
    from distllm.train.cli import (
        apply_plan,
        check_unused,
        config_from_args,
        given_layout,
        precheck,
    )

    args = _parse("train", argv)
    if world is None:
        assert args.nproc, "a `distllm train` outside torchrun needs --nproc N (or torchrun)"
        world = args.nproc
    try:
        cfg = config_from_args(args)
        if args.plan == "auto":  # (with the layout flags given pinned, as distllm train does)
            cfg, _ = apply_plan(cfg, world, given_layout(args))
        check_unused(args, cfg)
        precheck(cfg, world)
    except USAGE_ERRORS as exc:
        raise AssertionError(f"invalid at world size {world}: {exc}") from None


def _torchrun(tokens: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            tr = get_args_parser().parse_args(tokens[1:])
    except SystemExit:
        raise AssertionError(f"torchrun rejects its flags: {err.getvalue().strip()}") from None
    assert tr.module and tr.training_script == "distllm", "torchrun must run `-m distllm`"
    script = tr.training_script_args
    assert script and script[0] == "train", f"torchrun -m distllm {script[:1]}: not train"
    nodes, per_node = tr.nnodes, tr.nproc_per_node
    assert nodes.isdigit() and per_node.isdigit(), (
        f"--nnodes {nodes} --nproc-per-node {per_node}: give fixed numbers, so that the "
        "world size (and the layout check) is known")
    _train(script[1:], int(nodes) * int(per_node))


def _plan(argv: list[str]) -> None:
    from distllm.cli import main

    if "--calibrate" in argv:  # measures this machine: parsed only
        args = _parse("plan", argv)
        assert args.out, "--calibrate without --out overwrites the packaged cpu profile"
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", *argv])
    assert rc == 0, f"distllm plan exited {rc}: {err.getvalue().strip()}"
    assert out.getvalue().strip(), "distllm plan printed nothing"


def _bench(argv: list[str]) -> None:
    from distllm.bench.cli import _check
    from distllm.bench.suite import parse_suites

    from distllm.cli import main

    if argv == ["--list"]:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["bench", "--list"]) == 0
        return
    args = _parse("bench", argv)
    try:
        _check(args)  # what `distllm bench` validates before it runs anything
        parse_suites(args.suite)
    except ValueError as exc:
        raise AssertionError(f"distllm bench rejects it: {exc}") from None


def _make(targets: list[str]) -> None:
    assert targets, "a bare `make`: name the target"
    rules = re.findall(r"^([\w.$() -]+?)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M)
    declared = {t for line in rules for t in line.split()}
    for t in targets:  # a rule of the Makefile, not merely a file that exists (e.g. tests/)
        assert t in declared, f"make {t}: the Makefile has no rule {t!r}"
    p = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"make -n {' '.join(targets)}: {p.stderr.strip()}"


def check_command(cmd: str) -> None:
    """Raise AssertionError (saying why) unless ``cmd`` would run as the README says."""
    tokens = shlex.split(cmd, comments=True)
    if tokens[:3] == ["python", "-m", "distllm"]:
        tokens = ["distllm", *tokens[3:]]
    head = tokens[0]
    if head == "make":
        _make(tokens[1:])
    elif head == "torchrun":
        _torchrun(tokens)
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "train":
        _train(tokens[2:], None)
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "plan":
        _plan(tokens[2:])
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "bench":
        _bench(tokens[2:])
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "export":
        _parse("export", tokens[2:])  # its RUN is a training run's output: parsed only
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "sample":
        _parse("sample", tokens[2:])  # its RUN is a training run's output: parsed only
    elif head == "distllm" and len(tokens) > 1 and tokens[1] == "tokenize":
        _parse("tokenize", tokens[2:])  # its tokenizer is a user's folder: parsed only
    else:
        raise AssertionError(f"no check for {head!r} commands: add one to tests/test_readme.py")


COMMANDS = bash_commands(README.read_text())


def test_the_readme_has_the_commands_it_is_known_for():
    heads = {" ".join(shlex.split(c, comments=True)[:2]) for c in COMMANDS}
    assert {"make train", "make test", "distllm train", "distllm plan", "distllm bench"} <= heads
    assert any(c.startswith("torchrun ") for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_readme_command_runs(cmd):
    check_command(cmd)


@pytest.mark.parametrize(
    "cmd,why",
    [
        ("torchrun --nnodes 2 --nproc-per-node 8 -m distllm train --tp 8 --pp 2 --zero 1 "
         "--model gpt2-xl", "25 heads"),
        ("distllm train --nproc 4 --tp 3 --model tiny", "does not divide the world size 4"),
        ("distllm train --nproc 2 --tp 2 --no-such-flag", "rejects its flags"),
        ("distllm train --tp 2 --model tiny", "needs --nproc"),
        ("distllm train --nproc 2 --sequence-parallel --model tiny",  # a flag it would not use
         "--sequence-parallel shards activations inside a TP group"),
        ("distllm train --nproc 4 --plan auto --tp 3 --model tiny", "--tp 3"),  # a pin
        ("torchrun --nproc-per-node 2 -m distllm info", "not train"),
        ("torchrun --nnodes 1:4 --nproc-per-node 2 -m distllm train", "give fixed numbers"),
        ("distllm plan --model nope", "unknown model preset"),
        ("distllm plan --params 7.5e9 --gpus 64 --tp 3", "not divisible by tp*pp"),
        ("distllm bench --suite nope", "nope"),
        ("distllm bench --net fast", "--net"),
        ("make no-such-target", "no-such-target"),
        ("make tests", "no rule 'tests'"),  # a folder, not a target
        ("pip install distllm", "no check for 'pip'"),
    ],
)
def test_an_invalid_command_fails_the_check(cmd, why):
    with pytest.raises(AssertionError, match=re.escape(why)):
        check_command(cmd)


def test_bash_blocks_are_split_into_commands():
    text = ("```bash\nmake train   # a comment\n\n# only a comment\ndistllm plan \\\n"
            "  --model tiny\n```\n```python\nnot_a_command()\n```\n")
    assert bash_commands(text) == ["make train   # a comment", "distllm plan    --model tiny"]
