"""backend="auto"'s measured choice (distllm.ops.backend_choice), on stand-in candidates: a
candidate that raises is dropped and said so, every candidate raising is an error naming
each, and a choice persists across processes only in the file the user names."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from distllm.ops import backend_choice


def test_measure_drops_a_raising_candidate(caplog):
    def boom():
        raise RuntimeError("out of resources: shared memory")

    calls = {"ok": 0}

    def ok():
        calls["ok"] += 1

    with caplog.at_level(logging.WARNING, logger="distllm"):
        times = backend_choice.measure({"bad": boom, "ok": ok}, None, reps=3)
    assert set(times) == {"ok"} and calls["ok"] == 4  # warm-up + 3 timed
    assert any(
        "'bad' raised" in r.getMessage() and "shared memory" in r.getMessage()
        for r in caplog.records
    )
    backend_choice.clear()
    cands = {"bad": boom, "ok": ok}
    assert backend_choice.choose("fallback-test|1", torch.device("cpu"), cands) == "ok"
    with pytest.raises(RuntimeError, match=r"every candidate raised: bad: RuntimeError"):
        backend_choice.measure({"bad": boom}, None)


def test_choice_persists_only_where_asked(tmp_path, monkeypatch):
    # without DISTLLM_AUTOTUNE_CACHE a choice lives in this process only
    monkeypatch.delenv("DISTLLM_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    backend_choice.clear()
    fast = {"a": lambda: None, "b": lambda: sum(range(20000))}
    assert backend_choice.choose("persist-test|1", torch.device("cpu"), fast) == "a"
    assert not (tmp_path / "home").exists()
    # with it, the choice is written there and read back by a fresh cache
    path = tmp_path / "tune.json"
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(path))
    assert backend_choice.choose("persist-test|2", torch.device("cpu"), fast) == "a"
    assert any(k.endswith("persist-test|2") for k in json.loads(path.read_text()))
    backend_choice.clear()
    backend_choice._disk_loaded = False
    assert any(k.endswith("persist-test|2") for k in backend_choice.cached())


def test_a_cache_write_that_fails_leaves_nothing_beside_it(tmp_path, monkeypatch):
    """A full disk while the cache file is written: the choice stays in this process, the
    file as it was, and no temporary file beside it (one was left per failed write); a
    written cache has the permissions open() gives a new file, not the owner's alone."""
    import errno
    import os

    path = tmp_path / "tune.json"
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(path))
    backend_choice.clear()
    fast = {"a": lambda: None, "b": lambda: sum(range(20000))}
    assert backend_choice.choose("full-disk|1", torch.device("cpu"), fast) == "a"
    before = path.read_text()
    real = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    try:
        assert backend_choice.choose("full-disk|2", torch.device("cpu"), fast) == "a"
    finally:
        monkeypatch.setattr(os, "replace", real)
        backend_choice.clear()
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tune.json", "tune.json.lock"]
    plain = tmp_path / "plain"
    plain.write_text("")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_pinned_choices_take_the_first_candidate_untimed(tmp_path, monkeypatch):
    """``distllm train --deterministic``: the first candidate, never timed (a timed choice
    follows the machine's load, so two runs, or a run and its resumed continuation, could
    compute with different kernels), and a cache file's measured choices are not read."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(path))
    backend_choice.clear()
    slow_first = {"slow": lambda: sum(range(200000)), "fast": lambda: None}
    assert backend_choice.choose("pin-test|1", torch.device("cpu"), slow_first) == "fast"
    monkeypatch.setattr(backend_choice, "_pinned", False)
    monkeypatch.setattr(backend_choice, "_disk_loaded", False)
    try:
        backend_choice.pin()
        assert backend_choice.pinned()

        def untimed():
            raise AssertionError("a pinned choice runs no candidate")

        cands = {"slow": untimed, "fast": untimed}
        assert backend_choice.choose("pin-test|1", torch.device("cpu"), cands) == "slow"
        assert backend_choice.lookup("pin-test|1", torch.device("cpu")) == "slow"
    finally:
        backend_choice.clear()


def test_timing_waits_for_the_tensors_own_gpu(monkeypatch):
    # a bare torch.cuda.synchronize() waits for the current device only (cuda:0 where a rank
    # never set its own): the choice on cuda:1 would time the launches, not the kernels
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    backend_choice.clear()
    try:
        cands = {"a": lambda: None, "b": lambda: None}
        backend_choice.choose("sync-test|1", torch.device("cuda", 1), cands)
    finally:
        backend_choice.clear()
    assert synced and set(synced) == {torch.device("cuda", 1)}, synced


def test_a_cached_choice_this_process_cannot_run_is_chosen_again(tmp_path, monkeypatch):
    # a cache file written where distllm._cuda (or triton) ran, read where it does not:
    # backend="auto" takes the next backend, it does not fail naming "cuda"
    from distllm.ops import linear_gelu

    path = tmp_path / "tune.json"
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(path))
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    backend_choice.clear()
    linear_gelu(x, w)  # makes and writes its choice: the key it uses
    key = next(k for k in json.loads(path.read_text()) if k.split("|")[2] == "linear_gelu")
    path.write_text(json.dumps({key: "cuda"}))
    backend_choice.clear()
    backend_choice._disk_loaded = False
    try:
        y = linear_gelu(x, w)
        assert torch.allclose(y, torch.nn.functional.gelu(x @ w.T), atol=1e-5)
        assert backend_choice.cached()[key] in ("cpu", "reference")
    finally:
        backend_choice.clear()


def test_a_save_keeps_the_choices_other_processes_wrote(tmp_path, monkeypatch):
    # ranks of a job sharing one file: each wrote its whole memory over the file, dropping
    # the choices another rank saved after it had read the file
    path = tmp_path / "tune.json"
    monkeypatch.setenv("DISTLLM_AUTOTUNE_CACHE", str(path))
    backend_choice.clear()
    backend_choice._disk_loaded = False
    try:
        fast = {"a": lambda: None, "b": lambda: sum(range(20000))}
        backend_choice.choose("merge-test|1", torch.device("cpu"), fast)
        theirs = json.loads(path.read_text())
        path.write_text(json.dumps({**theirs, "other-rank|merge-test|2": "b"}))
        backend_choice.choose("merge-test|3", torch.device("cpu"), fast)
        saved = json.loads(path.read_text())
        assert saved["other-rank|merge-test|2"] == "b"
        assert any(k.endswith("merge-test|1") for k in saved)
        assert any(k.endswith("merge-test|3") for k in saved)
    finally:
        backend_choice.clear()
