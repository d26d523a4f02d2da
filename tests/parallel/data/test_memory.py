"""memory_report on a plain module and through ``held_tensors()`` (each storage counted once,
in the order params, grads, optimizer), and the ZeRO paper's per-rank model. ZeroOptimizer's
report against that model, per stage, is in test_zero.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.parallel.data.memory import MemoryReport, memory_report, zero_model_bytes


def test_plain_module_with_and_without_optimizer():
    m = nn.Linear(7, 5).double()  # 40 params: 320 bytes
    assert memory_report(m) == MemoryReport(320, 0, 0)
    m(torch.randn(3, 7, dtype=torch.float64)).sum().backward()
    opt = torch.optim.Adam(m.parameters())
    opt.step()  # two moments per parameter (640 bytes), a float32 step per tensor (2 x 4)
    rep = memory_report(m, opt)
    assert (rep.params, rep.grads, rep.optimizer) == (320, 320, 640 + 8)
    assert rep.as_dict() == {"params": 320, "grads": 320, "optimizer": 648, "total": 1288}


class _Holder:
    """Declares what it holds; a storage shared by two kinds counts once, in the first."""

    def __init__(self) -> None:
        self.flat = torch.zeros(100)  # 400 bytes
        self.view = self.flat[10:20]  # a view of it: no new bytes
        self.grad = torch.zeros(25)  # 100 bytes

    def held_tensors(self) -> dict:
        return {"params": [self.flat], "grads": [self.grad, self.view, None],
                "optimizer": [self.view, torch.zeros(0), 3.0]}


def test_held_tensors_count_each_storage_once():
    assert memory_report(_Holder()) == MemoryReport(400, 100, 0)


@pytest.mark.parametrize("stage,want", [(0, 16 * 1000), (1, 4 * 1000 + 12 * 1000 / 4),
                                        (2, 2 * 1000 + 14 * 1000 / 4), (3, 16 * 1000 / 4)])
def test_zero_paper_model(stage, want):
    assert zero_model_bytes(1000, 4, stage) == want
