"""Which backend ``backend="auto"`` runs: measured once per shape bucket and device, then
cached.

A key holds the GEMM's rows M (an input's leading dimensions flattened) rounded up to a
power of two (:func:`gemm_shape_key`), its other dimensions, the dtype and the flags
exactly: batches of varying sequence length share a choice instead of measuring at every new
length, as the overlap tuner's keys do (:class:`distllm.parallel.tensor.layers.OverlapPlan`).
The first call with a new key in a process times every candidate on the caller's own
tensors (a warm-up call, then a few interleaved repetitions, the fastest of them, through
:mod:`distllm.diagnostics.timing`) and remembers the fastest candidate in memory. The
unfused reference is always a candidate, so ``auto`` is never slower than unfused beyond
measurement noise. (Not to be confused with the overlap engines' tuner, which picks how a
tensor-parallel GEMM overlaps its collective.)

:func:`pin` (``distllm train --deterministic``) replaces the timing by a fixed rule: the
first candidate (the fused backend ahead of the unfused reference; oneDNN ahead of torch's
GEMM), so that two runs, or a run and its resumed continuation, compute with the same
kernels whatever the machine's load.

Choices persist across processes only when the user names a file in
``DISTLLM_AUTOTUNE_CACHE``: a choice measured while the machine was busy would otherwise
outlive the load that skewed it. Keys carry the device name and the torch version, so a
cache file copied to another machine or torch is not reused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from distllm.diagnostics.timing import device_sync, interleaved_samples, wall_timer
from distllm.files import write_text_atomic

log = logging.getLogger("distllm")

_lock = threading.Lock()
_memory: dict[str, str] = {}
_usable: set[str] = set()  # keys whose choice this process made, or found it can run
_disk_loaded = False
_pinned = False


def pin() -> None:
    """From now on every choice is the first candidate, without timing (reproducible runs:
    the timing picks by the machine's load). Choices made before, and the cache file, are
    dropped for this process."""
    global _pinned, _disk_loaded, _generation
    with _lock:
        _pinned, _disk_loaded = True, True  # the file's measured choices are not read
        _memory.clear()
        _generation += 1


def unpin() -> None:
    """Undo :func:`pin`: choices are measured again (the pinned ones are dropped, and the
    cache file, if one is named, is read again)."""
    global _pinned, _disk_loaded, _generation
    with _lock:
        if _pinned:
            _pinned, _disk_loaded = False, False
            _memory.clear()
            _generation += 1


def pinned() -> bool:
    """Whether :func:`pin` fixed the choices."""
    return _pinned


def cache_path() -> Path | None:
    """The JSON file that keeps choices across processes, if the user asked for one."""
    path = os.environ.get("DISTLLM_AUTOTUNE_CACHE")
    return Path(path) if path else None


_CORES = os.cpu_count()  # read once: it reads a file, and lookup() runs on every CPU GEMM


def device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_CORES}cores:{torch.get_num_threads()}threads"


def rows_bucket(m: int) -> int:
    """``m`` rows rounded up to a power of two (1, 2, 4, 8, ...): the rows in a choice's key,
    so that the row counts in (2^(k-1), 2^k] share one measurement. 0 stays 0: an empty
    problem has nothing to time and is no sample of a non-empty one."""
    return 1 << (m - 1).bit_length() if m > 0 else 0


def gemm_shape_key(x: torch.Tensor, w: torch.Tensor) -> str:
    """The shapes in a choice's key for a GEMM of ``x`` (..., K) with a weight ``w``:
    ``"(rows<=R, K)x<w's shape>"``, R the rows ``prod(x.shape[:-1])`` rounded up by
    :func:`rows_bucket`; K and ``w``'s shape exact."""
    rows = math.prod(x.shape[:-1])
    return f"(rows<={rows_bucket(rows)}, {x.shape[-1]})x{tuple(w.shape)}"


def _load_disk() -> None:
    global _disk_loaded
    if _disk_loaded:
        return
    _disk_loaded = True
    if cache_path() is None:
        return
    try:
        data = json.loads(cache_path().read_text())
        if isinstance(data, dict):
            for k, v in data.items():
                _memory.setdefault(str(k), str(v))
    except (OSError, ValueError):
        pass


def _save_disk() -> None:
    """Write the choices into the cache file: under a lock, merged with what the file holds
    now (other processes sharing it, such as the ranks of a job, write theirs too; a
    process's own choices win), then renamed over it."""
    path = cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                theirs = json.loads(path.read_text()) if path.exists() else {}
            except ValueError:
                theirs = {}
            merged = {**(theirs if isinstance(theirs, dict) else {}), **_memory}
            write_text_atomic(path, json.dumps(merged, indent=0, sort_keys=True))
    except OSError as exc:
        log.debug("backend choice cache not written (%s)", exc)


def measure(
    candidates: dict[str, Callable[[], object]], sync: Callable[[], None] | None, reps: int = 3
) -> dict[str, float]:
    """Fastest ms of each candidate over ``reps`` interleaved rounds after one warm-up round.

    The minimum, not the median: other work on the machine only ever adds time, so the
    minimum is the better estimate of a candidate's own cost on a shared machine.

    A candidate that raises is dropped (and logged), so that one backend failing on these
    inputs does not take ``auto`` down with it; if every candidate raises, RuntimeError."""
    failed: dict[str, str] = {}
    samples = interleaved_samples(
        candidates, warmup=1, reps=reps, timer=wall_timer(sync), errors=failed
    )
    for n, why in failed.items():
        log.warning("backend choice: candidate %r raised (%s); dropped", n, why)
    out = {n: min(s) for n, s in samples.items() if s}
    if not out:
        raise RuntimeError(
            "backend choice: every candidate raised: "
            + "; ".join(f"{n}: {why}" for n, why in failed.items())
        )
    return out


def lookup(key: str, device: torch.device,
           usable: Callable[[str], bool] | None = None) -> str | None:
    """The choice already made for ``key`` on ``device``, or None (a cheap, hot-path check).
    ``usable(name)``: whether that backend can run now; a choice read from the cache file
    (made by a process that had an extension this one lacks, say) is checked with it once,
    and one it refuses is None (:func:`choose` measures again)."""
    full = f"{device_tag(device)}|torch{torch.__version__}|{key}"
    hit = _memory.get(full)
    if hit is None and not _disk_loaded:
        with _lock:
            _load_disk()
        hit = _memory.get(full)
    if hit is not None and usable is not None and full not in _usable:
        if not usable(hit):
            return None
        _usable.add(full)
    return hit


def choose(
    key: str,
    device: torch.device,
    candidates: dict[str, Callable[[], object]],
    grad: bool = False,
) -> str:
    """The fastest candidate's name for ``key`` on ``device``, measured once and cached.

    ``grad``: the candidates run a backward, so they are timed with autograd enabled."""
    if len(candidates) == 1:
        return next(iter(candidates))
    full = f"{device_tag(device)}|torch{torch.__version__}|{key}"
    with _lock:
        _load_disk()
        hit = _memory.get(full)
    if hit in candidates:
        return hit
    if _pinned:
        best = next(iter(candidates))
        with _lock:
            _memory[full] = best
            _usable.add(full)
        return best
    with torch.enable_grad() if grad else torch.no_grad():
        times = measure(candidates, device_sync(device), reps=5)
    best = min(times, key=times.__getitem__)
    log.info(
        "backend choice %s: %s (%s)",
        full,
        best,
        ", ".join(f"{n}={t:.3g}ms" for n, t in times.items()),
    )
    with _lock:
        _memory[full] = best
        _usable.add(full)
        _save_disk()
    return best


def cached() -> dict[str, str]:
    """A copy of the choices made so far (for ``distllm info`` and tests)."""
    with _lock:
        _load_disk()
        return dict(_memory)


_generation = 0  # bumped by clear(): memos of the choices are valid within one


def generation() -> int:
    """Changes whenever :func:`clear` forgets the choices (callers memoizing them check it)."""
    return _generation


def clear(memory_only: bool = True) -> None:
    """Forget the choices (in memory; also on disk unless ``memory_only``)."""
    global _disk_loaded, _generation
    with _lock:
        _memory.clear()
        _usable.clear()
        _generation += 1
        _disk_loaded = memory_only  # do not reload the file we are forgetting
        if not memory_only and cache_path() is not None:
            try:
                cache_path().unlink()
            except OSError:
                pass
