"""Host memory: glibc keeps what a step freed once :func:`keep_freed_memory` ran, and
``distllm train`` runs it on CPU unless told not to (``--no-keep-freed-memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distllm.testing import run_distributed
from distllm.train.cli import add_arguments, config_from_args
from tests.train._util import make_cfg

_REFAULT = """
import resource, sys, torch
from distllm.train.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # a step's 64 MiB of activations, allocated, written and freed
    t = torch.empty(64 << 20, dtype=torch.uint8)
    t.fill_(1)
    del t
# glibc settles within four steps: the heap may need two 64 MiB regions before a freed one
# stays free for the next step (faults seen at steps 1-4 of 20 runs, never after)
for _ in range(6):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_kept_freed_memory_is_not_faulted_in_again():
    """With glibc keeping freed memory, a step that reallocates what the last one freed
    takes no page faults; by default each 64 MiB allocation faults in all its pages."""

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _REFAULT, mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    kept, default = faults("keep"), faults("default")
    assert kept < 500, f"{kept} page faults in 4 steps with freed memory kept"
    assert default > 4 * 10_000, f"only {default} faults by default: the test cannot tell"


def _calls_of_train(data: str, out: str, keep: bool) -> int:
    """Rank function: how many times one CPU training run asked glibc to keep freed memory."""
    import distllm.train.trainer as trainer

    calls: list[int] = []
    trainer.keep_freed_memory = lambda: calls.append(1) or True
    trainer.train(make_cfg(data, out, steps=1, dtype="float32", keep_freed_memory=keep))
    return len(calls)


def _parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_train_keeps_freed_memory_on_cpu_unless_told_not_to(corpus, tmp_path):
    assert _parse(["--no-keep-freed-memory"]).keep_freed_memory is False
    assert _parse([]).keep_freed_memory is True
    for keep, want in ((True, 1), (False, 0)):
        got = run_distributed(_calls_of_train, 1, corpus, str(tmp_path / str(keep)), keep,
                              timeout=120)
        assert got == [want], f"keep_freed_memory={keep}: called {got[0]} times, want {want}"
