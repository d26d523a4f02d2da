"""distllm.comm.compat: each wrapper picks torch's newer collective where it exists and the
older one otherwise, and both paths give the same results on 2 gloo ranks (float64)."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.distributed as dist

from distllm.comm import compat
from distllm.testing import run_distributed

WORLD = 2
SHAPE = (3, 7, 5)  # per-rank piece: odd sizes, 3-D (collectives run along dim 0)
RTOL = 1e-12  # float64 sum of 2 terms: one rounding, in the same order on every rank
HAS_NEW = hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def _piece(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input; every rank can recompute every other rank's."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64)


def _full(rank: int) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input: WORLD pieces along dim 0."""
    g = torch.Generator().manual_seed(2000 + rank)
    return torch.randn((WORLD * SHAPE[0], *SHAPE[1:]), generator=g, dtype=torch.float64)


def _collectives(path: str) -> dict:
    """Run both wrappers (blocking and async) with ``path`` ("new" or "fallback") chosen."""
    mod = compat
    if path == "fallback":  # emulate a torch without the *_single collectives, in this rank
        for name in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, name):
                delattr(dist, name)
        mod = importlib.reload(compat)
    rank = dist.get_rank()
    gathered = torch.empty(WORLD * SHAPE[0], *SHAPE[1:], dtype=torch.float64)
    mod.all_gather_into(gathered, _piece(rank))
    gathered_async = torch.full_like(gathered, float("nan"))
    work = mod.all_gather_into(gathered_async, _piece(rank), async_op=True)
    work.wait()
    scattered = torch.empty(SHAPE, dtype=torch.float64)
    mod.reduce_scatter_into(scattered, _full(rank), group=dist.group.WORLD)
    scattered_async = torch.full_like(scattered, float("nan"))
    work = mod.reduce_scatter_into(scattered_async, _full(rank), async_op=True)
    work.wait()
    return {  # tensors as nested lists (exact for float64): shared memory dies with the rank
        "apis": (mod.ALL_GATHER_API, mod.REDUCE_SCATTER_API),
        "fns": (mod._all_gather.__name__, mod._reduce_scatter.__name__),
        "gathered": [t.tolist() for t in (gathered, gathered_async)],
        "scattered": [t.tolist() for t in (scattered, scattered_async)],
    }


_PATHS = [
    pytest.param(
        "new",
        ("all_gather_single", "reduce_scatter_single"),
        marks=pytest.mark.skipif(
            not HAS_NEW,
            reason=f"torch {torch.__version__} has no *_single collectives: only the fallback "
            "exists here (CI's torch 2.14.1 pass runs this)",
        ),
    ),
    pytest.param("fallback", ("all_gather_into_tensor", "reduce_scatter_tensor")),
]


@pytest.mark.parametrize("path,apis", _PATHS)
def test_both_paths_match_a_float64_reference(path, apis):
    results = run_distributed(_collectives, WORLD, path, timeout=120)
    want_gather = torch.cat([_piece(r) for r in range(WORLD)])  # (WORLD*3, 7, 5), rank order
    total = sum(_full(r) for r in range(WORLD))  # (WORLD*3, 7, 5)
    for rank, out in enumerate(results):
        assert out["apis"] == apis
        assert out["fns"] == apis  # the function called is the one named
        for got in out["gathered"]:
            got = torch.tensor(got, dtype=torch.float64)
            torch.testing.assert_close(got, want_gather, rtol=0, atol=0)  # a copy: exact
        want_scatter = total[rank * SHAPE[0] : (rank + 1) * SHAPE[0]]
        for got in out["scattered"]:
            got = torch.tensor(got, dtype=torch.float64)
            torch.testing.assert_close(got, want_scatter, rtol=RTOL, atol=0)


def test_import_picks_the_newer_api_when_present():
    assert compat.ALL_GATHER_API == (
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )
    assert compat.REDUCE_SCATTER_API == (
        "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )


def test_pick_prefers_new_then_old():
    new, old = object(), object()
    both = types.SimpleNamespace(fresh=new, legacy=old)
    only_old = types.SimpleNamespace(legacy=old)
    assert compat._pick(both, "fresh", "legacy") == ("fresh", new)
    assert compat._pick(only_old, "fresh", "legacy") == ("legacy", old)
    with pytest.raises(AttributeError):
        compat._pick(types.SimpleNamespace(), "fresh", "legacy")


@pytest.fixture
def restore_precision():
    m = torch.backends.cuda.matmul
    saved = (torch.backends.fp32_precision, m.fp32_precision)
    yield
    torch.backends.fp32_precision, m.fp32_precision = saved


@pytest.mark.parametrize("how,want", [
    ("legacy-on", True), ("legacy-off", False), ("matmul-tf32", True), ("matmul-ieee", False),
    ("global-tf32", True), ("default", False),
])
def test_tf32_switch_reads_either_api(restore_precision, how, want):
    """TF32 set through torch's newer API (where reading the legacy ``allow_tf32`` raises)
    reads the same as set through the legacy one; the GEMM backends and the trainer's MFU
    ask this, at every float32 call."""
    from distllm.comm.compat import tf32_matmul_allowed

    m = torch.backends.cuda.matmul
    torch.backends.fp32_precision, m.fp32_precision = "none", "none"
    if how.startswith("legacy"):
        m.allow_tf32 = how == "legacy-on"
    elif how.startswith("matmul"):
        m.fp32_precision = how.split("-")[1]
    elif how == "global-tf32":
        torch.backends.fp32_precision = "tf32"
    assert tf32_matmul_allowed() is want
