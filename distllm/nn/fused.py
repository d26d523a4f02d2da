"""Drop-in fused layers: :class:`FusedLinearGeLU` (``nn.Linear`` then GeLU as one op) and
:func:`fuse`, which reads Linear -> GeLU pairs (and Linear -> GeLU -> Linear MLPs) from each
block's ``torch.fx`` graph and swaps them in place.

A :class:`FusedLinearGeLU` alone has the fused op's backward (one pass for the GeLU
derivative, with the bias gradient where the backend fuses it, then the two GEMMs). An MLP
that :func:`fuse` finds whole is computed by one function whose backward also fuses the GeLU
derivative into the second Linear's input-gradient GEMM
(:func:`distllm.parallel.tensor.fused_mlp.dense_mlp`, as ``ParallelMLP`` at tp=1).

No collective runs in forward or backward (single-device layers).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from distllm.ops.linear_gelu import linear_gelu

__all__ = ["FusedLinearGeLU", "fuse", "gelu_approximate"]

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


class FusedLinearGeLU(nn.Module):
    """``gelu(x @ weight.T + bias)``: a drop-in for ``nn.Linear(in, out)`` followed by
    ``nn.GELU(approximate)``, with the same parameter names and shapes as ``nn.Linear``.

    ``backend`` is passed to :func:`distllm.ops.linear_gelu` ("auto" picks the fastest
    measured backend per shape and device). Under ``torch.autocast`` it behaves as
    ``nn.Linear``: the input and parameters are cast to the autocast dtype (float64 is left
    alone) and the gradients reach the parameters in their own dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        approximate: str = "none",
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.approximate, self.backend = approximate, backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, approximate: str = "none", *, backend: str = "auto"
    ) -> FusedLinearGeLU:
        """A FusedLinearGeLU sharing ``linear``'s parameters (same Parameter objects, so
        optimizer state, weight tying and state_dict keys carry over)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.approximate, m.backend = approximate, backend
        m.weight = w
        m.bias = linear.bias
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu(
            x, self.weight, self.bias, approximate=self.approximate, backend=self.backend
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, approximate={self.approximate!r}"
        )


class _FusedConv1DGeLU(nn.Module):
    """Hugging Face ``Conv1D`` (weight stored (in, out), y = x @ W + b) followed by GeLU.

    Keeps the ``Conv1D`` parameters as they are (same objects, same (in, out) layout, so
    checkpoints still load) and passes ``weight.t()`` (a view) to the fused op.
    """

    def __init__(self, conv, approximate: str, backend: str = "auto"):
        super().__init__()
        self.nf = conv.nf
        self.weight = conv.weight  # (in, out)
        self.bias = conv.bias  # (out,)
        self.approximate, self.backend = approximate, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (..., in) @ W (in, out) == linear(x, W.t() (out, in))
        return linear_gelu(
            x, self.weight.t(), self.bias, approximate=self.approximate, backend=self.backend
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.weight.shape[0]}, out_features={self.nf}, "
            f"approximate={self.approximate!r} (Conv1D layout)"
        )


def gelu_approximate(act) -> str | None:
    """``"none"`` / ``"tanh"`` if ``act`` (module or function) is a GeLU, else None."""
    if isinstance(act, nn.GELU):
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


def _fusable_linear(m) -> str | None:
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


class _FusedMLPHead(FusedLinearGeLU):
    """The first Linear of a Linear -> GeLU -> Linear chain swapped by :func:`fuse`: it
    computes the whole chain (the GeLU's slot becomes an identity, the second Linear's a
    :class:`_FusedAway` that keeps its parameters under their names), so that the backward
    is fused across the two GEMMs. Its own parameters are the first Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distllm.nn.parallel_linear import _autocast_operands
        from distllm.parallel.tensor.fused_mlp import dense_mlp, resolve_backend

        tail = self._tail
        x, w1, b1, dev = _autocast_operands(x, self.weight, self.bias)
        _, w2, b2, _ = _autocast_operands(x, tail.weight, tail.bias)
        with torch.autocast(dev, enabled=False):
            needs_grad = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (x, w1, b1, w2, b2))
            name = resolve_backend(self.backend, x.reshape(-1, x.shape[-1]), w1, b1,
                                   self.approximate, needs_grad)
            return dense_mlp(x, w1, b1, w2, b2, self.approximate, name, self._plans)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", then the next Linear (fused MLP)"


class _FusedAway(nn.Module):
    """Holds the second Linear's parameters (same objects, same names) after :func:`fuse`
    folded its GEMM into the :class:`_FusedMLPHead` before it; passes its input through."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}: computed "
                "by the fused MLP before it")


def _fused_mlp(fc1: nn.Linear, fc2: nn.Linear, approximate: str) -> tuple[nn.Module, nn.Module]:
    from distllm.parallel.tensor.fused_mlp import single_device_plans

    head = _FusedMLPHead.from_linear(fc1, approximate)
    tail = _FusedAway(fc2)
    object.__setattr__(head, "_tail", tail)  # a reference, not a submodule (no double names)
    head._plans = single_device_plans("fused MLP")  # made once, not per forward
    return head, tail


def _fused(fc, approximate: str) -> nn.Module:
    if _fusable_linear(fc) == "linear":
        return FusedLinearGeLU.from_linear(fc, approximate)
    return _FusedConv1DGeLU(fc, approximate)


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


def _trace(block: nn.Module) -> torch.fx.Graph | None:
    """``block.forward`` as a graph whose nodes call its children (GeLU function attributes
    included, as modules of the same name); optional arguments defaulting to None are traced
    as None. None, with a debug log, if the block cannot be traced."""
    fn_attrs = {k: v for k, v in vars(block).items() if _is_gelu_attr(k, v)}
    for name, fn in fn_attrs.items():  # restored below, whatever the trace does
        delattr(block, name)
        block._modules[name] = _GeluAttribute(fn)
    try:
        params = inspect.signature(type(block).forward).parameters
        concrete = {n: None for n, p in params.items() if n != "self" and p.default is None}
        return _ChildrenAsLeaves().trace(block, concrete_args=concrete or None)
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


def _is_gelu_attr(name: str, value) -> bool:
    """A GeLU function (not module) stored on a block."""
    return (
        not name.startswith("_")
        and not isinstance(value, nn.Module)
        and callable(value)
        and gelu_approximate(value) is not None
    )


def _pairs(block: nn.Module, graph: torch.fx.Graph) -> list[tuple[str, str, str, str | None]]:
    """(fc, act, approximate, fc2) for each child Linear (or HF Conv1D) whose output has one
    consumer, a child GeLU called on it alone; each called once in the graph. ``fc2`` names
    the child ``nn.Linear`` that alone consumes the GeLU's output, once, when ``fc`` is an
    ``nn.Linear`` too (a whole MLP), else None."""
    calls = [n for n in graph.nodes if n.op == "call_module" and "." not in n.target]
    times = {}
    for n in calls:
        times[n.target] = times.get(n.target, 0) + 1
    out = []
    for node in calls:
        fc = getattr(block, node.target)
        if not _fusable_linear(fc) or times[node.target] != 1 or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_module" or "." in user.target or times[user.target] != 1:
            continue
        if user.args != (node,) or user.kwargs:
            continue
        ap = gelu_approximate(getattr(block, user.target))
        if ap is not None:
            out.append((node.target, user.target, ap, _consumer_linear(block, user, times)
                        if _fusable_linear(fc) == "linear" else None))
    return out


def _consumer_linear(block: nn.Module, act_node, times: dict) -> str | None:
    """The child ``nn.Linear`` that alone consumes ``act_node``'s output, called once on it."""
    if len(act_node.users) != 1:
        return None
    (user,) = act_node.users
    if user.op != "call_module" or "." in user.target or times.get(user.target) != 1:
        return None
    if user.args != (act_node,) or user.kwargs:
        return None
    return user.target if type(getattr(block, user.target)) is nn.Linear else None


def _fuse_block(block: nn.Module) -> int:
    children = dict(block.named_children())
    if not any(_fusable_linear(m) for m in children.values()):
        return 0
    if not any(gelu_approximate(m) for m in children.values()) and not any(
        _is_gelu_attr(k, v) for k, v in vars(block).items()
    ):
        return 0
    graph = _trace(block)
    if graph is None:
        return 0
    pairs = _pairs(block, graph)
    for fc_name, act_name, ap, fc2_name in pairs:
        if fc2_name is not None:
            head, tail = _fused_mlp(getattr(block, fc_name), getattr(block, fc2_name), ap)
            setattr(block, fc_name, head)
            setattr(block, fc2_name, tail)
        else:
            setattr(block, fc_name, _fused(getattr(block, fc_name), ap))
        if isinstance(getattr(block, act_name), nn.Module):
            setattr(block, act_name, nn.Identity())
        else:  # a function attribute (e.g. F.gelu): replaced by the identity function
            object.__setattr__(block, act_name, _identity)
    return len(pairs)


def _identity(x):
    return x


def fuse(model: nn.Module) -> int:
    """Swap every Linear -> GeLU pair of ``model`` in place for one fused layer; returns how
    many were swapped.

    Reads the pairs from each block's graph: every module whose children include a Linear
    (or Hugging Face ``Conv1D``) and a GeLU (a module, or a GeLU function stored as an
    attribute) is traced with ``torch.fx``, its children kept whole, and a Linear whose
    output feeds only a GeLU, each called once, is a pair. This covers ``nn.Sequential`` and
    Hugging Face MLP blocks (GPT-2's ``Conv1D``, BERT). The Linear becomes a
    :class:`FusedLinearGeLU` sharing its parameters (a ``Conv1D`` keeps its (in, out)
    layout), the GeLU an identity. When the GeLU's output in turn feeds only a child
    ``nn.Linear`` (a whole MLP), the first Linear's replacement computes the MLP, with the
    backward fused across the two GEMMs, and the second Linear's slot keeps its parameters
    under their names and passes its input through. Everything else (other activations,
    Linear subclasses, outputs used twice, blocks that cannot be traced) is left alone;
    outputs change only by the dtype's rounding.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse needs an nn.Module, got {type(model).__name__}")
    count = 0
    for m in list(model.modules()):
        if isinstance(m, (FusedLinearGeLU, _FusedConv1DGeLU, _FusedAway)):
            continue
        if type(m).forward is not nn.Module.forward:
            count += _fuse_block(m)
    return count
