"""``train`` ends the ``torch.distributed`` world it started (a process that exits with
gloo's process group alive can abort in the interpreter's teardown, and the launcher then
reports a failed rank after a finished run), and leaves a world it was given alone; what
``--deterministic`` fixed for its run ends with it. Each case runs in a fresh interpreter,
whose state at exit is the one ``train`` left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_RUN = """
import sys
import torch.distributed as dist
from distllm.train.trainer import train
from tests.train._util import make_cfg
given = sys.argv[3] == "given"
if given:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
res = train(make_cfg(sys.argv[1], sys.argv[2], steps=2))
print(len(res.losses), dist.is_initialized())
"""


def _after_train(corpus: str, out: str, world: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _RUN, corpus, out, world],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_train_destroys_the_world_it_started(corpus, tmp_path):
    assert _after_train(corpus, str(tmp_path), "started") == ["2", "False"]


def test_train_leaves_a_world_it_was_given(corpus, tmp_path):
    assert _after_train(corpus, str(tmp_path), "given") == ["2", "True"]


_DETERMINISTIC = """
import sys
import torch
from distllm.ops import backend_choice
from distllm.parallel.tensor import overlap_tuner
from distllm.train.trainer import train
from tests.train._util import make_cfg
res = train(make_cfg(sys.argv[1], sys.argv[2], steps=2, deterministic=True))
print(len(res.losses), backend_choice.pinned(), overlap_tuner.pinned(),
      torch.are_deterministic_algorithms_enabled())
"""


def test_deterministic_ends_with_its_run(corpus, tmp_path):
    """A later run in the same process (a notebook's, a sweep's) measures its kernels and
    overlap again, and torch's deterministic mode is as it was."""
    done = subprocess.run([sys.executable, "-c", _DETERMINISTIC, corpus, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["2", "False", "False", "False"]


def _train_in_a_world_without_rank(corpus: str, out: str) -> int:
    """Rank function: the world is the caller's, and RANK is not in the environment (a world
    started from a file or TCP store): train() reads the rank from the world."""
    import os

    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    os.environ.pop("RANK", None)
    return len(train(make_cfg(corpus, out, steps=1)).losses)


def test_train_in_a_callers_world_without_rank_locks_out_once(corpus, tmp_path):
    """Only rank 0 locks --out: every rank of a world started without RANK took itself for
    rank 0, and all but one were refused as "another run"."""
    from distllm.testing import run_distributed

    assert run_distributed(_train_in_a_world_without_rank, 2, corpus, str(tmp_path / "run"),
                           timeout=120) == [1, 1]
