"""ParallelDims on every factorisation of 1, 2, 4 and 8 gloo ranks, against an independent
computation of the groups, plus the errors that name the knob."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from distllm.parallel.mesh import ParallelDims, mesh_groups
from distllm.testing import DistributedFailure, run_distributed


def _expected(world, tp, pp, dp, rank):
    """Groups by brute force over a (pp, dp, tp) grid built with numpy-style indexing."""
    grid = torch.arange(world).reshape(pp, dp, tp)
    idx = (grid == rank).nonzero()[0].tolist()
    p, d, t = idx
    return {
        "tp": grid[p, d, :].tolist(),
        "dp": grid[p, :, t].tolist(),
        "pp": grid[:, d, t].tolist(),
        "coords": (p, d, t),
        "next": grid[p + 1, d, t].item() if p + 1 < pp else None,
        "prev": grid[p - 1, d, t].item() if p > 0 else None,
    }


def _check_mesh(tp, pp, dp_arg):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp_arg)
    world, rank = dist.get_world_size(), dist.get_rank()
    exp = _expected(world, tp, pp, dims.dp, rank)
    assert dims.coords == tuple(exp["coords"])
    assert dims.group_ranks("tp") == exp["tp"]
    assert dims.group_ranks("dp") == exp["dp"]
    assert dims.group_ranks("pp") == exp["pp"]
    assert dims.next_pp_rank == exp["next"] and dims.prev_pp_rank == exp["prev"]
    assert dims.is_first_stage == (exp["coords"][0] == 0)
    assert dims.is_last_stage == (exp["coords"][0] == pp - 1)
    # the process groups really contain those ranks: all-gather of the global rank
    for name in ("tp", "dp", "pp"):
        g = getattr(dims, f"{name}_group")
        n = dist.get_world_size(g)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(out, torch.tensor([rank]), group=g)
        assert [int(t) for t in out] == exp[name], (name, out, exp[name])
    return dims.coords


def _factorisations(world):
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp) == 0:
            yield tp, pp, world // (tp * pp)


CASES = [(w, *f) for w in (1, 2, 4, 8) for f in _factorisations(w)]


@pytest.mark.parametrize(
    "world,tp,pp,dp", CASES, ids=[f"w{w}-tp{t}-pp{p}-dp{d}" for w, t, p, d in CASES]
)
def test_mesh_groups(world, tp, pp, dp):
    # dp passed explicitly on half the cases and inferred (-1) on the others
    dp_arg = dp if (tp + pp) % 2 == 0 else -1
    coords = run_distributed(_check_mesh, world, tp, pp, dp_arg, timeout=120)
    assert sorted(coords) == sorted(itertools.product(range(pp), range(dp), range(tp)))


def test_mesh_groups_pure():
    g = mesh_groups(8, tp=2, pp=2, dp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["pp_tp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def _bad(tp, pp, dp):
    ParallelDims(tp=tp, pp=pp, dp=dp)


@pytest.mark.parametrize(
    "tp,pp,dp,knob",
    [
        (3, 1, -1, "tp\\*pp"),  # 4 ranks not divisible by 3
        (2, 2, 2, "does not match the world size 4"),
        (0, 1, -1, "tp=0"),
        (1, -2, -1, "pp=-2"),
        (1, 1, 0, "dp=0"),
    ],
)
def test_mesh_bad_sizes_name_the_knob(tp, pp, dp, knob):
    with pytest.raises(DistributedFailure, match=f"ValueError: .*{knob}"):
        run_distributed(_bad, 4, tp, pp, dp, timeout=60)


def test_single_process_without_torchrun(monkeypatch):
    # ParallelDims starts a 1-rank gloo world itself when none is running
    code = (
        "import distllm, torch.distributed as dist\n"
        "d = distllm.ParallelDims()\n"
        "assert dist.is_initialized() and d.world_size == 1 and d.dp == 1\n"
        "assert d.coords == (0, 0, 0)\n"
        "print('ok')\n"
    )
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
