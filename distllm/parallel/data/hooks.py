"""The hooks a data-parallel wrapper (:class:`~distllm.parallel.DistributedDataParallel`,
:class:`~distllm.parallel.ZeroOptimizer`) installs on the user's model, and which wrapper
owns a model's parameters.

* Every hook calls its wrapper's parts through a weak reference (:func:`weak_hook`). A hook
  torch keeps on a parameter or module that held its wrapper strongly made a cycle through
  torch's C++ hook table that Python's collector cannot see: a dropped wrapper, its buckets
  and optimizer states stayed alive with the model. Once the wrapper is gone its hooks do
  nothing.
* One wrapper owns a parameter at a time (:func:`take_over`), as one optimizer steps it: a
  new wrapper of parameters an earlier live wrapper still hooks removes that wrapper's hooks
  (its gradient hook set the gradients the new one reduces to zero). Parameters a ZeRO-3
  wrapper sharded keep only their shard (:func:`mark_sharded`): wrapping them again is a
  ValueError that says what to do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["weak_hook", "removed_with", "remove_hooks", "take_over", "mark_sharded"]

_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref to its wrapper
_SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the wrapper's name


def weak_hook(owner: object, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook calling ``fn(owner, *args)`` while ``owner`` lives, and returning None after."""
    ref = weakref.ref(owner)

    def hook(*args: Any, **kwargs: Any) -> Any:
        obj = ref()
        return None if obj is None else fn(obj, *args, **kwargs)

    return hook


def removed_with(owner: object, handles: list) -> list:
    """``handles`` (a list its owner keeps appending to, and empties in place when it removes
    them), removed when ``owner`` is collected: a dropped wrapper leaves no hook behind."""
    weakref.finalize(owner, remove_hooks, handles)
    return handles


def remove_hooks(handles: list) -> None:
    """Remove ``handles``' hooks and empty the list in place."""
    for h in handles:
        h.remove()
    handles.clear()


def take_over(params: Iterable[nn.Parameter], wrapper: object, what: str) -> None:
    """Make ``wrapper`` (named ``what`` in errors) the owner of ``params``. A parameter an
    earlier ZeRO-3 wrapper sharded is a ValueError; a live earlier owner of any of them loses
    all its hooks (its ``remove_hooks()``)."""
    params = list(params)
    for p in params:
        if p in _SHARDED:
            raise ValueError(
                f"{what}: the model's parameters were sharded by {_SHARDED[p]}, which keeps "
                "only this rank's shard of each: wrap a model once at stage 3; to start "
                "again, build a fresh model and load a full state dict into it (the old "
                "optimizer's full_state_dict())")
    earlier: dict[int, object] = {}
    for p in params:
        ref = _OWNER.get(p)
        old = ref() if ref is not None else None
        if old is not None and old is not wrapper:
            earlier[id(old)] = old
    for old in earlier.values():
        old.remove_hooks()
    me = weakref.ref(wrapper)
    for p in params:
        _OWNER[p] = me


def mark_sharded(params: Iterable[nn.Parameter], what: str) -> None:
    """Record that ``what`` sharded ``params`` (their values live in its shards from now on)."""
    for p in params:
        _SHARDED[p] = what
