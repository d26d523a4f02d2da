"""At most one device-to-host read per optimizer step in ``distllm train``'s loop, counted
on CPU: every ``item`` / ``tolist`` / ``float()`` / ``int()`` / ``bool()`` / ``numpy`` /
``cpu`` that distllm's code calls on a tensor (on a GPU each of these waits for the device
to drain its queue). The count of one whole step is taken between two successive batches
of the loader, after the first step (one-time work such as building the pipeline's message
shapes is not per step). A batch's copy to the GPU does not make the host wait either."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from distllm.testing import run_distributed
from tests.train._util import make_cfg

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")
PKG = os.path.dirname(os.path.abspath(sys.modules["distllm"].__file__)) + os.sep
STEPS = 4


def _count_per_step(runs: list[dict], data: str, out: str) -> list[list[list[str]]]:
    """Rank function: train each of ``runs``; per step after the first, the reads made by
    distllm's code (``file:line``)."""
    from distllm.train import data as data_mod
    from distllm.train.trainer import train

    reads: list[str] = []
    steps: list[list[str]] = []
    orig_next = data_mod.BatchLoader.next

    def next_batch(self):  # a step begins: close the previous one
        steps.append(list(reads))
        reads.clear()
        return orig_next(self)

    def counted(name: str, fn):
        def read(t, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PKG):
                reads.append(f"{name} at {caller[len(PKG):]}:{sys._getframe(1).f_lineno}")
            return fn(t, *args, **kwargs)

        return read

    saved = {n: getattr(torch.Tensor, n) for n in READS}
    inherited = {n for n in READS if n not in vars(torch.Tensor)}
    data_mod.BatchLoader.next = next_batch
    for n, fn in saved.items():
        setattr(torch.Tensor, n, counted(n, fn))
    results = []
    try:
        for i, kw in enumerate(runs):
            steps.clear()
            train(make_cfg(data, f"{out}/run{i}", steps=STEPS, **kw))
            results.append(steps[2:])  # [0] is before step 1, [1] is step 1
    finally:
        data_mod.BatchLoader.next = orig_next
        for n, fn in saved.items():
            if n in inherited:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, fn)
    return results


CASES = {  # world: layouts
    1: [dict(m=2), dict(m=2, dtype="bfloat16")],
    2: [dict(dp=2, zero=2, m=2), dict(pp=2, m=2), dict(tp=2, zero=3, overlap="auto")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_one_host_read_per_step(corpus, tmp_path, world):
    per_run = run_distributed(_count_per_step, world, CASES[world], corpus, str(tmp_path),
                              timeout=600)
    for rank, runs in enumerate(per_run):
        for kw, steps in zip(CASES[world], runs, strict=True):
            assert len(steps) == STEPS - 2, (kw, steps)
            for k, reads in enumerate(steps):
                # one read per step and rank: the metrics (loss, norm, inf/NaN flag) together
                assert len(reads) == 1, (
                    f"rank {rank} {kw}: step {k + 2} read the device {len(reads)} times: {reads}")


def test_a_batch_reaches_the_gpu_without_blocking(monkeypatch):
    """A copy from pageable memory makes the host wait for the GPU's stream (the previous
    step's optimizer kernels) before the next step can queue: the batch goes through pinned
    memory, non-blocking; on the CPU it is a plain copy."""
    from distllm.train.engine import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda self, *a, **k: calls.append(("to", a, k)) or self)
    batch = torch.zeros(2, 3, dtype=torch.long)
    gpu = torch.device("cuda", 1)
    to_device(batch, gpu)
    assert calls == ["pin", ("to", (gpu,), {"non_blocking": True})]
    calls.clear()
    to_device(batch, torch.device("cpu"))
    assert calls == [("to", (torch.device("cpu"),), {})]
