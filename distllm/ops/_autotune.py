"""Measured backend choice for ``backend="auto"``, cached per shape and device.

The first call with a new key in a process times every candidate on the caller's own
tensors (a warm-up call, then a few interleaved repetitions, the fastest of them) and
remembers the fastest candidate in memory. The unfused reference is always a candidate, so
``auto`` is never slower than unfused beyond measurement noise.

Choices persist across processes only when the user names a file in
``DISTLLM_AUTOTUNE_CACHE``: a choice measured while the machine was busy would otherwise
outlive the load that skewed it. Keys carry the device name and the torch version, so a
cache file copied to another machine or torch is not reused.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("distllm")

_lock = threading.Lock()
_memory: dict[str, str] = {}
_disk_loaded = False


def cache_path() -> Path | None:
    """The JSON file that keeps choices across processes, if the user asked for one."""
    path = os.environ.get("DISTLLM_AUTOTUNE_CACHE")
    return Path(path) if path else None


def device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


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
    path = cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(_memory, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("autotune cache not written (%s)", exc)


def _time_ms(fn: Callable[[], object], sync: Callable[[], None] | None) -> float:
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) * 1e3


def measure(
    candidates: dict[str, Callable[[], object]], sync: Callable[[], None] | None, reps: int = 3
) -> dict[str, float]:
    """Fastest ms of each candidate over ``reps`` interleaved rounds after one warm-up round.

    The minimum, not the median: other work on the machine only ever adds time, so the
    minimum is the better estimate of a candidate's own cost on a shared machine.

    A candidate that raises is dropped (and logged), so that one backend failing on these
    inputs does not take ``auto`` down with it; if every candidate raises, RuntimeError."""
    names = list(candidates)
    failed: dict[str, str] = {}

    def attempt(n: str) -> float | None:
        try:
            return _time_ms(candidates[n], sync)
        except Exception as exc:  # noqa: BLE001 - any failure disqualifies the candidate
            failed[n] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("autotune: candidate %r raised (%s); dropped", n, failed[n])
            return None

    for n in names:  # warm-up round
        attempt(n)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for n in names if i % 2 == 0 else names[::-1]:
            if n not in failed and (t := attempt(n)) is not None:
                samples[n].append(t)
    out = {n: min(s) for n, s in samples.items() if n not in failed and s}
    if not out:
        raise RuntimeError(
            "autotune: every candidate raised: "
            + "; ".join(f"{n}: {why}" for n, why in failed.items())
        )
    return out


def lookup(key: str, device: torch.device) -> str | None:
    """The choice already made for ``key`` on ``device``, or None (a cheap, hot-path check)."""
    full = f"{device_tag(device)}|torch{torch.__version__}|{key}"
    hit = _memory.get(full)
    if hit is None and not _disk_loaded:
        with _lock:
            _load_disk()
        hit = _memory.get(full)
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
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    with torch.enable_grad() if grad else torch.no_grad():
        times = measure(candidates, sync, reps=5)
    best = min(times, key=times.__getitem__)
    log.info(
        "autotune %s: %s (%s)", full, best, ", ".join(f"{n}={t:.3g}ms" for n, t in times.items())
    )
    with _lock:
        _memory[full] = best
        _save_disk()
    return best


def cached() -> dict[str, str]:
    """A copy of the choices made so far (for ``distllm info`` and tests)."""
    with _lock:
        _load_disk()
        return dict(_memory)


def clear(memory_only: bool = True) -> None:
    """Forget the choices (in memory; also on disk unless ``memory_only``)."""
    global _disk_loaded
    with _lock:
        _memory.clear()
        _disk_loaded = memory_only  # do not reload the file we are forgetting
        if not memory_only and cache_path() is not None:
            try:
                cache_path().unlink()
            except OSError:
                pass
