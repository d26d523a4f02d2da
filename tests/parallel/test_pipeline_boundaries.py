"""Stage boundaries that carry no gradient, and a batch that takes one, on every schedule,
against the same layers on one process (float64).

- a batch that requires grad gets its gradient once (zero-bubble's split backward had
  given it twice: once through the micro-batch's view, once as another leaf of the graph);
- a frozen first stage (fine-tuning with a frozen embedding) has nothing to backpropagate;
- an integer activation crossing a boundary (the token ids, before the embedding) has no
  gradient to send back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distllm.testing import run_distributed
from tests._errors import worst
from tests.parallel.test_pipeline import HID, SEQ, VOCAB, Block, loss_fn, make_batch

TOL = 1e-12
CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("zb-h1", 2, 1), ("zb-h1", 1, 1),
         ("interleaved-1f1b", 2, 2)]


def _layers(kind: str, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    first = {"float": nn.Linear(HID, HID), "frozen": nn.Embedding(VOCAB, HID),
             "int": nn.Identity()}[kind]
    layers = [first] + ([nn.Embedding(VOCAB, HID)] if kind == "int" else [])
    layers += [Block(HID) for _ in range(3)] + [nn.Linear(HID, VOCAB)]
    if kind == "frozen":
        first.requires_grad_(False)
    return [layer.double() for layer in layers]


def _stages(kind: str, v: int) -> list[int]:
    n = len(_layers(kind))
    if v > 1:  # 4 chunks over 2 ranks: the first chunk holds the first layer alone
        return [1, 1, 1, n - 3]
    return [1, n - 1]


def _rank(kind: str, schedule: str, m: int, v: int) -> dict:
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=2, dp=1)
    tokens, targets = make_batch(4, 1)
    batch = (torch.randn(4, SEQ, HID, dtype=torch.float64, generator=torch.Generator()
                         .manual_seed(2)).requires_grad_(True) if kind == "float" else tokens)
    ref_layers = _layers(kind)
    ref_in = batch.detach().clone().requires_grad_(True) if kind == "float" else batch
    ref = loss_fn(nn.Sequential(*ref_layers)(ref_in), targets)
    ref.backward()
    layers = _layers(kind)
    pp = PipelineParallel(layers, dims, schedule, m, v, layers_per_stage=_stages(kind, v))
    loss = pp.train_step(batch, targets, loss_fn)
    errs = [abs(loss - ref.item())]
    for mine, theirs in zip(layers, ref_layers, strict=True):
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            if p.grad is not None or q.grad is not None:
                if any(p is r for c in pp.chunks for r in c.parameters()):
                    errs.append(float((p.grad - q.grad).abs().max()))
    if kind == "float" and pp.is_first:
        errs.append(float((batch.grad - ref_in.grad).abs().max()))
    return {"err": worst(errs), "checked": len(errs)}


@pytest.mark.parametrize("kind", ["float", "frozen", "int"])
def test_boundaries_without_a_gradient_and_a_batch_with_one(kind):
    for schedule, m, v in CASES:
        out = run_distributed(_rank, 2, kind, schedule, m, v, timeout=120)
        for r, res in enumerate(out):
            assert res["err"] < TOL, (kind, schedule, m, v, r, res)
        # the losses, and the gradients of the layers that take one
        assert sum(res["checked"] for res in out) > 4, (kind, schedule, out)
