"""What :func:`distllm.nn.fuse` may swap in one block, read from the block's ``torch.fx``
graph: which child Linear (or Hugging Face ``Conv1D``) feeds only a child GeLU, and whether
that GeLU in turn feeds only a child ``nn.Linear`` (a whole MLP).

A block whose ``forward`` has optional arguments defaulting to None is traced once per
combination of them (each None, or a symbolic value), and only the edges found in every
trace count, so that code run only when an argument is given (a gate on the hidden units, a
mask) is never fused across. A combination that cannot be traced leaves the block alone.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["Pair", "block_pairs", "consumer_of", "gelu_approximate", "fusable_linear",
           "is_gelu_attr"]

log = logging.getLogger("distllm")

# Activation classes (matched by name, so transformers need not be installed) -> approximate.
# All of these compute GeLU exactly or in its tanh form; QuickGELU (x * sigmoid(1.702 x)) and
# ClippedGELU are other functions and are left alone.
_GELU_CLASSES = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}

# At most this many None-default arguments (2**n traces); a block with more is left alone.
MAX_OPTIONAL_ARGS = 4


class Pair(NamedTuple):
    """Child names: ``fc`` -> ``act`` (a GeLU of ``approximate``), then ``fc2`` (the
    ``nn.Linear`` that alone consumes the GeLU's output) or None."""

    fc: str
    act: str
    approximate: str
    fc2: str | None


def gelu_approximate(act) -> str | None:
    """``"none"`` / ``"tanh"`` if ``act`` (module or function) is a GeLU, else None."""
    if type(act) is nn.GELU:  # a subclass may compute something else: left alone
        return act.approximate
    if isinstance(act, nn.Module):
        name = type(act).__name__
        if name not in _GELU_CLASSES:
            return None
        inner = getattr(act, "act", None)  # GELUActivation(use_gelu_python=...) etc.
        if name in ("GELUActivation", "GELUTanh") and inner is not None:
            return _GELU_CLASSES[name] if _is_gelu_fn(inner) or _is_method(inner) else None
        return _GELU_CLASSES[name]
    if act is F.gelu or act is torch.nn.functional.gelu:
        return "none"
    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args:
        ap = act.keywords.get("approximate", "none")
        return ap if ap in ("none", "tanh") else None
    return None


def _is_gelu_fn(fn) -> bool:
    return fn is F.gelu or (isinstance(fn, functools.partial) and fn.func is F.gelu)


def _is_method(fn) -> bool:
    return inspect.ismethod(fn) and fn.__name__ in ("_gelu_python", "_gelu_tanh_python")


def fusable_linear(m) -> str | None:
    """The kind of a fusable layer: "linear" (plain nn.Linear), "conv1d" (HF Conv1D) or None."""
    if type(m) is nn.Linear:
        return "linear"
    w = getattr(m, "weight", None)
    if (
        type(m).__name__ == "Conv1D"
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.shape[1] == getattr(m, "nf", None)
    ):
        return "conv1d"
    return None


def is_gelu_attr(name: str, value) -> bool:
    """A GeLU function (not module) stored on a block."""
    return (
        not name.startswith("_")
        and not isinstance(value, nn.Module)
        and callable(value)
        and gelu_approximate(value) is not None
    )


class _GeluAttribute(nn.Module):
    """Stands in, while a block is traced, for a GeLU *function* stored as an attribute
    (``self.act = F.gelu``), so that its call shows in the graph under the attribute's name."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _ChildrenAsLeaves(torch.fx.Tracer):
    """Traces one block's own ``forward`` only: every submodule call is one graph node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _optional_args(block: nn.Module) -> list[str]:
    params = inspect.signature(type(block).forward).parameters
    return [n for n, p in params.items() if n != "self" and p.default is None]


def _traces(block: nn.Module, optional: list[str]) -> list[torch.fx.Graph] | None:
    """``block.forward`` as graphs whose nodes call its children (GeLU function attributes
    included, as modules of the same name), one per combination of the ``optional``
    arguments fixed to None or traced symbolically. None, with a debug log, if any
    combination cannot be traced."""
    fn_attrs = {k: v for k, v in vars(block).items() if is_gelu_attr(k, v)}
    for name, fn in fn_attrs.items():  # restored below, whatever the trace does
        delattr(block, name)
        block._modules[name] = _GeluAttribute(fn)
    try:
        graphs = []
        for given in itertools.product((False, True), repeat=len(optional)):
            concrete = {n: None for n, g in zip(optional, given, strict=True) if not g}
            graphs.append(_ChildrenAsLeaves().trace(block, concrete_args=concrete or None))
        return graphs
    except Exception as exc:  # noqa: BLE001 - an untraceable block is left as it is
        log.debug(
            "fuse: %s not traced, left alone (%s: %s)",
            type(block).__name__,
            type(exc).__name__,
            exc,
        )
        return None
    finally:
        for name, fn in fn_attrs.items():
            del block._modules[name]
            object.__setattr__(block, name, fn)


def _only_call_on(node, times: dict) -> torch.fx.Node | None:
    """The one user of ``node`` if it is a child module called once, on ``node`` alone."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op != "call_module" or "." in user.target or times.get(user.target) != 1:
        return None
    return user if user.args == (node,) and not user.kwargs else None


def _graph_pairs(block: nn.Module, graph: torch.fx.Graph) -> list[Pair]:
    """Each child Linear (or HF Conv1D) called once whose output feeds only a child GeLU,
    called once on it alone; ``fc2`` when ``fc`` is an ``nn.Linear`` and the GeLU's output
    feeds only a child ``nn.Linear`` called once on it alone."""
    calls = [n for n in graph.nodes if n.op == "call_module" and "." not in n.target]
    times: dict[str, int] = {}
    for n in calls:
        times[n.target] = times.get(n.target, 0) + 1
    out = []
    for node in calls:
        kind = fusable_linear(getattr(block, node.target))
        act = _only_call_on(node, times) if kind and times[node.target] == 1 else None
        ap = gelu_approximate(getattr(block, act.target)) if act is not None else None
        if ap is None:
            continue
        tail = _only_call_on(act, times) if kind == "linear" else None
        if tail is not None and type(getattr(block, tail.target)) is not nn.Linear:
            tail = None
        out.append(Pair(node.target, act.target, ap, tail.target if tail is not None else None))
    return out


def _common(per_trace: list[list[Pair]]) -> list[Pair]:
    """The pairs of the first trace found (fc -> act, same approximate) in every trace; an
    ``fc2`` kept only where every trace has it. In a chain (one pair's ``fc2`` is another
    pair's ``fc``) every GeLU is fused and only the last pair takes its ``fc2``."""
    out = []
    for p in per_trace[0]:
        same = [[q for q in t if q[:3] == p[:3]] for t in per_trace[1:]]
        if all(same):
            fc2 = p.fc2 if all(s[0].fc2 == p.fc2 for s in same) else None
            out.append(p._replace(fc2=fc2))
    heads = {p.fc for p in out}
    return [p._replace(fc2=None) if p.fc2 in heads else p for p in out]


def block_pairs(block: nn.Module) -> list[Pair]:
    """The Linear -> GeLU pairs (and whole MLPs) of ``block``'s own ``forward`` that
    :func:`distllm.nn.fuse` may swap; [] for a block it must leave alone."""
    children = dict(block.named_children())
    if not any(fusable_linear(m) for m in children.values()):
        return []
    if not any(gelu_approximate(m) for m in children.values()) and not any(
        is_gelu_attr(k, v) for k, v in vars(block).items()
    ):
        return []
    optional = _optional_args(block)
    if len(optional) > MAX_OPTIONAL_ARGS:
        log.debug(
            "fuse: %s has %d optional arguments (over %d), left alone",
            type(block).__name__,
            len(optional),
            MAX_OPTIONAL_ARGS,
        )
        return []
    graphs = _traces(block, optional)
    if graphs is None:
        return []
    return _common([_graph_pairs(block, g) for g in graphs])


def consumer_of(block: nn.Module, child: str) -> str | None:
    """What ``block``'s forward (its optional arguments None) applies to child ``child``'s
    output, for messages: a child module's repr, a function's or method's name; None if the
    block cannot be traced or the output does not go to one consumer."""
    graphs = _traces(block, [])
    if graphs is None:
        return None
    calls = [n for n in graphs[0].nodes if n.op == "call_module" and n.target == child]
    if len(calls) != 1 or len(calls[0].users) != 1:
        return None
    (user,) = calls[0].users
    if user.op == "call_module":
        return repr(getattr(block, user.target, user.target))
    if user.op == "call_function":
        return getattr(user.target, "__name__", str(user.target))
    return f".{user.target}()" if user.op == "call_method" else None
