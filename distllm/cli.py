"""The ``distllm`` command: a thin dispatcher to its subcommands.

``info``, ``train``, ``bench``, ``plan``, ``export`` and ``tokenize``.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen one is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "info": ("distllm.info", "versions, devices, and which backends are built and usable"),
    "train": ("distllm.train.cli", "train a GPT on TP x PP x DP x ZeRO (torchrun or --nproc)"),
    "bench": ("distllm.bench.cli", "microbenchmarks: fused vs unfused, overlap, report"),
    "plan": ("distllm.plan.cli", "choose TP x PP x DP x ZeRO x schedule for a model and cluster"),
    "export": ("distllm.train.export", "a training checkpoint as a Hugging Face GPT-2 folder"),
    "tokenize": ("distllm.train.tokenize_data",
                 "text as a tokenizer's ids, the train.bin and val.bin that --data reads"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


USAGE_ERRORS = (UsageError, ValueError, FileNotFoundError)
"""The exceptions a subcommand raises for bad input: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        if not argv or argv[0] in ("-h", "--help"):
            top.print_help()
            return 0 if argv else 2
        top.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    name = argv[0]
    modname, help_ = COMMANDS[name]
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name and modname.startswith(exc.name):
            print(f"distllm {name}: not available in this build ({exc})", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"distllm {name}", description=help_)
    mod.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(mod.run(args) or 0)
    except USAGE_ERRORS as exc:
        print(f"distllm {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
