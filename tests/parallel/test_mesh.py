"""ParallelDims: its validation and rank arithmetic without processes, then its groups on every
factorisation of 1, 2, 4 and 8 gloo ranks, against an independent computation of the groups,
and the errors that name the knob."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distllm.parallel.mesh import ParallelDims, mesh_groups
from distllm.testing import run_distributed
from tests._spawn import SpawnCache, case_of, run_cases


def _expected(world, tp, pp, dp, rank):
    """Groups by brute force over a (pp, dp, tp) grid built with numpy-style indexing."""
    grid = torch.arange(world).reshape(pp, dp, tp)
    p, d, t = (grid == rank).nonzero()[0].tolist()
    return {
        "tp": grid[p, d, :].tolist(),
        "dp": grid[p, :, t].tolist(),
        "pp": grid[:, d, t].tolist(),
        "pp_tp": grid[:, d, :].flatten().tolist(),
        "coords": (p, d, t),
        "next": grid[p + 1, d, t].item() if p + 1 < pp else None,
        "prev": grid[p - 1, d, t].item() if p > 0 else None,
    }


def _factorisations(world):
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp) == 0:
            yield tp, pp, world // (tp * pp)


CASES = [(w, *f) for w in (1, 2, 4, 8) for f in _factorisations(w)]
IDS = [f"w{w}-tp{t}-pp{p}-dp{d}" for w, t, p, d in CASES]


# --- validation: no processes ----------------------------------------------------------


@pytest.mark.parametrize("world,tp,pp,dp", CASES, ids=IDS)
def test_validation_and_rank_arithmetic_need_no_processes(world, tp, pp, dp):
    dims = ParallelDims(tp=tp, pp=pp, dp=-1, world_size=world)
    assert dims.dp == dp and not dims.is_built
    assert ParallelDims(tp=tp, pp=pp, dp=dp, world_size=world).dp == dp
    for rank in range(world):
        exp = _expected(world, tp, pp, dp, rank)
        assert dims.coords_of(rank) == exp["coords"]
        for name in ("tp", "dp", "pp", "pp_tp"):
            mine = [g for g in dims.groups[name] if rank in g]
            assert mine == [exp[name]], (name, rank, mine, exp[name])
    # every family partitions the world
    for groups in dims.groups.values():
        assert sorted(r for g in groups for r in g) == list(range(world))
    assert not dist.is_initialized()


def test_mesh_groups_by_hand():
    g = mesh_groups(8, tp=2, pp=2, dp=2)
    assert g == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pp_tp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    }


BAD = [
    (3, 1, -1, "dp=-1 cannot be inferred: world size 4 is not divisible by tp\\*pp=3"),
    (2, 2, 2, "tp\\*pp\\*dp = 2\\*2\\*2 = 8 does not match the world size 4: set dp=-1"),
    (0, 1, -1, "tp=0: it must be a positive integer"),
    (1, -2, -1, "pp=-2: it must be a positive integer"),
    (1, 1, 0, "dp=0: it must be a positive integer, or -1"),
]


@pytest.mark.parametrize("tp,pp,dp,words", BAD)
def test_bad_sizes_name_the_knob(tp, pp, dp, words):
    with pytest.raises(ValueError, match=words):
        ParallelDims(tp=tp, pp=pp, dp=dp, world_size=4)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kw,words", [
    (dict(tp=True), "tp=True"),
    (dict(tp=2.0), "tp=2.0"),
    (dict(dp="2"), "dp='2'"),
    (dict(world_size=0), "world_size=0"),
])
def test_non_integers_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        ParallelDims(**{"world_size": 4, **kw})


def test_an_unbuilt_mesh_says_to_build_it():
    dims = ParallelDims(tp=2, world_size=4)
    for attr in ("rank", "coords", "tp_group", "dp_group", "pp_group", "model_parallel_group",
                 "world_group", "device", "next_pp_rank"):
        with pytest.raises(RuntimeError, match=r"call \.build\(\) on every rank"):
            getattr(dims, attr)
    assert "not built" in repr(dims)
    with pytest.raises(ValueError, match="rank=4: choose a rank in 0..3"):
        dims.coords_of(4)


def test_build_refuses_a_world_of_another_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="world_size=2, but the job has 1 ranks: pass "
                                         "world_size=1"):
        ParallelDims(world_size=2).build()
    assert not dist.is_initialized()  # refused before starting anything


def test_from_layout_reads_any_layout():
    from distllm.plan.layout import Layout
    from distllm.train.config import ParallelConfig

    for layout in (ParallelConfig(tp=2, pp=2, dp=-1), Layout(2, 2, 2),
                   SimpleNamespace(tp=2, pp=2, dp=2)):
        dims = ParallelDims.from_layout(layout, world_size=8, timeout_s=5.0)
        assert (dims.tp, dims.pp, dims.dp, dims.timeout_s) == (2, 2, 2, 5.0), layout
    with pytest.raises(ValueError, match="does not match the world size 4"):
        ParallelDims.from_layout(Layout(2, 2, 2), world_size=4)


# --- building: gloo ranks --------------------------------------------------------------


def _check_mesh(tp, pp, dp_arg, two_steps):
    world, rank = dist.get_world_size(), dist.get_rank()
    if two_steps:
        dims = ParallelDims(tp=tp, pp=pp, dp=dp_arg, world_size=world)
        assert not dims.is_built
        assert dims.build() is dims and dims.is_built
    else:
        dims = ParallelDims(tp=tp, pp=pp, dp=dp_arg)
    exp = _expected(world, tp, pp, dims.dp, rank)
    assert dims.coords == tuple(exp["coords"])
    for name in ("tp", "dp", "pp", "pp_tp"):
        assert dims.group_ranks(name) == exp[name]
    assert dims.next_pp_rank == exp["next"] and dims.prev_pp_rank == exp["prev"]
    assert dims.is_first_stage == (exp["coords"][0] == 0)
    assert dims.is_last_stage == (exp["coords"][0] == pp - 1)
    # the process groups really contain those ranks: all-gather of the global rank
    for name, attr in (("tp", "tp_group"), ("dp", "dp_group"), ("pp", "pp_group"),
                       ("pp_tp", "model_parallel_group")):
        g = getattr(dims, attr)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(g))]
        dist.all_gather(out, torch.tensor([rank]), group=g)
        assert [int(t) for t in out] == exp[name], (name, out, exp[name])
    return dims.coords


def mesh_main() -> dict:
    """Every factorisation of this world, one after the other in one spawn: dp passed
    explicitly on half the cases and inferred (-1) on the others; the groups built by the
    constructor on some and by an explicit build() on the others."""
    cases = {}
    for world, tp, pp, dp in CASES:
        if world == dist.get_world_size():
            dp_arg = dp if (tp + pp) % 2 == 0 else -1
            two_steps = (tp * 3 + pp) % 2 == 0
            cases[f"tp{tp}-pp{pp}-dp{dp}"] = (
                lambda a=(tp, pp, dp_arg, two_steps): _check_mesh(*a))
    return run_cases(cases)


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(timeout=120)


@pytest.mark.parametrize("world,tp,pp,dp", CASES, ids=IDS)
def test_mesh_groups(spawned, world, tp, pp, dp):
    coords = case_of(spawned(mesh_main, world), f"tp{tp}-pp{pp}-dp{dp}")
    assert sorted(coords) == sorted(itertools.product(range(pp), range(dp), range(tp)))


def _bad(tp, pp, dp) -> str:
    try:
        ParallelDims(tp=tp, pp=pp, dp=dp)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def bad_main() -> dict:
    """Every bad size of :data:`BAD` in one running world of 4 (the same error on every
    rank, none of which builds a group)."""
    return run_cases({f"{tp},{pp},{dp}": (lambda a=(tp, pp, dp): _bad(*a))
                      for tp, pp, dp, _ in BAD})


@pytest.mark.parametrize("tp,pp,dp,words", BAD)
def test_bad_sizes_under_a_running_world(spawned, tp, pp, dp, words):
    for got in case_of(spawned(bad_main, 4), f"{tp},{pp},{dp}"):
        assert re.search(f"ValueError: {words}", got), got


def test_single_process_without_torchrun():
    # ParallelDims starts a 1-rank gloo world itself when none is running
    code = (
        "import distllm, torch.distributed as dist\n"
        "d = distllm.ParallelDims()\n"
        "assert dist.is_initialized() and d.world_size == 1 and d.dp == 1\n"
        "assert d.coords == (0, 0, 0) and d.is_built\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("config,cuda,want", [
    ("cuda:nccl", True, "cuda"),
    # init_process_group() without a backend on a CUDA machine: get_backend says "undefined"
    ("cpu:gloo,cuda:nccl", True, "cuda"),
    ("cpu:gloo,cuda:gloo", True, "cpu"),  # gloo for both: the CPU, as with "gloo"
    ("cpu:gloo", False, "cpu"),
    ("cuda:nccl", False, "cpu"),  # no CUDA in this process
])
def test_the_device_follows_the_backend_that_serves_cuda(monkeypatch, config, cuda, want):
    """The mesh's device (where the model, and every tensor that meets a collective, lives)
    is CUDA wherever NCCL serves CUDA tensors, whatever name the group's backend has."""
    from distllm.comm import collectives
    from distllm.parallel import mesh

    dims = mesh.ParallelDims(tp=1, pp=1, dp=1)  # sizes only: no world is started
    monkeypatch.setattr(collectives.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(collectives.dist, "get_backend",
                        lambda group=None: "undefined" if "," in config else config[5:])
    monkeypatch.setattr(collectives.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(mesh.ParallelDims, "_built", lambda self: None)
    expect = torch.device("cuda", 2) if want == "cuda" else torch.device("cpu")
    assert dims.device == expect
    assert collectives.backend_for(None, "cuda") == dict(
        p.split(":") for p in config.split(",")).get("cuda")
    assert collectives.backend_for(None, "xpu") is None


@pytest.mark.parametrize("env,want", [
    ({"RANK": "5", "LOCAL_RANK": "1"}, 1),
    ({"RANK": "5", "SLURM_LOCALID": "3"}, 3),
    ({"RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 2),
    ({"RANK": "5"}, 1),  # 4 GPUs visible: the global rank modulo 4
    ({"RANK": "7", "SLURM_LOCALID": "6"}, 2),  # 4 visible (srun's --gpus-per-task=4)
])
def test_each_rank_picks_its_own_gpu(monkeypatch, env, want):
    from distllm.parallel import mesh

    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "RANK"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(mesh.torch.cuda, "device_count", lambda: 4)
    assert mesh._local_device() == want


def _stalled_peer(timeout_s: float) -> float | None:
    import time

    import torch

    dims = ParallelDims(tp=2, timeout_s=timeout_s)
    if dims.rank == 1:  # a stalled rank: never joins the TP all-reduce
        time.sleep(4 * timeout_s)
        return None
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4), group=dims.tp_group)
    except RuntimeError:
        return time.perf_counter() - t0
    return -1.0


def test_a_stalled_rank_fails_a_subgroup_collective_within_the_timeout():
    """Every group the mesh creates waits at most ``timeout_s`` (a subgroup made without
    one waits torch's 30-minute default: a stalled rank hung the job)."""
    took = run_distributed(_stalled_peer, 2, 2.0, timeout=120)[0]
    assert took is not None and 0 < took < 8.0, took


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_world_started_here_on_nccl_sets_the_ranks_gpu_first(monkeypatch, backend):
    """A backend string that gives CUDA tensors to NCCL sets the rank's GPU before the
    world starts, "cpu:gloo,cuda:nccl" as "nccl" (before, only the exact "nccl" did, and
    every rank of the other ran on GPU 0)."""
    from distllm.parallel import mesh

    calls = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(mesh.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(mesh.torch.cuda, "set_device", lambda d: calls.append(("set", d)))
    monkeypatch.setattr(mesh.dist, "init_process_group",
                        lambda **kw: calls.append(("init", kw["backend"])))
    mesh._init_from_env(backend, mesh.datetime.timedelta(seconds=5))
    assert calls == [("set", 3), ("init", backend)]
    calls.clear()
    mesh._init_from_env("gloo", mesh.datetime.timedelta(seconds=5))
    assert calls == [("init", "gloo")]


@pytest.mark.parametrize("current,want", [(0, [1]), (1, []), (3, [])])
def test_a_world_started_by_the_caller_gets_the_ranks_gpu_unless_one_was_chosen(
        monkeypatch, current, want):
    """``init_process_group("nccl")`` by the caller, then the mesh: a rank still on the
    default GPU 0 is moved to its own (LOCAL_RANK), which NCCL needs (two ranks on one GPU
    are refused); a rank that chose a GPU keeps it."""
    from distllm.parallel import mesh

    got = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(mesh, "_current_world_size", lambda: 2)
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mesh.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(mesh, "backend_for", lambda group, kind: "nccl")
    monkeypatch.setattr(mesh.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mesh.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(mesh.torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(mesh.torch.cuda, "set_device", got.append)
    monkeypatch.setattr(mesh.dist, "new_subgroups_by_enumeration",
                        lambda ranks, timeout: (object(), None))
    mesh.ParallelDims(tp=2, world_size=2).build()
    assert got == want
