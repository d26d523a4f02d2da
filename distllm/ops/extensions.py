"""The compiled extensions ``distllm._C`` (CPU) and ``distllm._cuda`` (CUDA), loaded on
first use.

Each is a plain module of kernels (``csrc/ops.h``, ``csrc/cuda/ops.h``); loading one
registers nothing. The ops that call them are registered by their own modules in
:mod:`distllm.ops`; ``distllm info`` reports :func:`is_built` and :func:`status`.

A missing or broken extension is not an error: :func:`load` returns ``None``, warns once
with the reason, and callers fall back to the next backend. :func:`status` tells why.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from types import ModuleType

import torch

log = logging.getLogger("distllm")

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_reasons: dict[str, str] = {}


def load(name: str) -> ModuleType | None:
    """Import ``distllm.<name>`` (``_C`` or ``_cuda``) once; ``None`` (with a warning) if absent."""
    if name in _loaded:  # the hot path: no lock once decided
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        mod: ModuleType | None = None
        try:
            if name == "_cuda" and not torch.cuda.is_available():
                raise ImportError("no CUDA device is visible to torch")
            mod = importlib.import_module(f"distllm.{name}")
        except (ImportError, OSError) as exc:  # a missing .so, or one built for another torch
            _reasons[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("distllm.%s unavailable (%s); using the next backend", name, _reasons[name])
        _loaded[name] = mod
        return mod


def is_built(name: str) -> bool:
    """Whether the compiled file exists, whether or not it can be used on this machine."""
    return importlib.util.find_spec(f"distllm.{name}") is not None


def status(name: str) -> tuple[bool, str]:
    """(usable, reason) for an extension, loading it if needed."""
    mod = load(name)
    return (mod is not None, "ok" if mod is not None else _reasons.get(name, "unavailable"))
