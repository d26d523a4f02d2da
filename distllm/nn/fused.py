"""Drop-in fused layers: :class:`FusedLinearGeLU` (``nn.Linear`` then GeLU as one op) and
:func:`fuse`, which swaps Linear -> GeLU pairs of an existing model in place.

No collective runs in forward or backward (single-device layers).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from distllm.ops.linear_gelu import linear_gelu

__all__ = ["FusedLinearGeLU", "fuse", "gelu_approximate"]

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


def _fused(fc, approximate: str) -> nn.Module:
    if _fusable_linear(fc) == "linear":
        return FusedLinearGeLU.from_linear(fc, approximate)
    return _FusedConv1DGeLU(fc, approximate)


def _fuse_sequential(seq: nn.Sequential) -> int:
    names = list(seq._modules)
    n = 0
    for a, b in zip(names, names[1:], strict=False):
        fc, act = seq._modules[a], seq._modules[b]
        ap = gelu_approximate(act) if act is not None else None
        if fc is not None and _fusable_linear(fc) and ap is not None:
            seq._modules[a] = _fused(fc, ap)
            seq._modules[b] = nn.Identity()
            n += 1
    return n


def _forward_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """(fc, act) attribute pairs whose output flows only fc -> act in ``forward``'s source:
    ``self.act(self.fc(x))``, or ``h = self.fc(x)`` directly followed by ``h = self.act(h)``."""
    try:
        src = textwrap.dedent(inspect.getsource(type(module).forward))
    except (OSError, TypeError):
        return []
    pairs = []
    nested = r"(?=self\.(\w+)\(\s*self\.(\w+)\()"  # lookahead: overlapping f(g(h(x)))
    for outer, inner in re.findall(nested, src):
        pairs.append((inner, outer))
    two_line = (
        r"(?<![\w.])(\w+)\s*=\s*self\.(\w+)\([^()\n]*\)\s*\n"
        r"\s*\1\s*=\s*self\.(\w+)\(\s*\1\s*\)"
    )
    for _var, fc, act in re.findall(two_line, src):
        pairs.append((fc, act))
    # a layer called more than once in forward is not a simple fc -> act edge
    return [
        (fc, act)
        for fc, act in pairs
        if len(re.findall(rf"self\.{fc}\(", src)) == 1
        and len(re.findall(rf"self\.{act}\(", src)) == 1
    ]


def _fuse_block(module: nn.Module) -> int:
    n = 0
    for fc_name, act_name in _forward_pairs(module):
        fc = getattr(module, fc_name, None)
        act = getattr(module, act_name, None)
        ap = gelu_approximate(act) if act is not None else None
        if fc is None or ap is None or not _fusable_linear(fc):
            continue
        setattr(module, fc_name, _fused(fc, ap))
        if isinstance(act, nn.Module):
            setattr(module, act_name, nn.Identity())
        else:  # a function attribute (e.g. F.gelu): replace by the identity function
            object.__setattr__(module, act_name, _identity)
        n += 1
    return n


def _identity(x):
    return x


def fuse(model: nn.Module) -> int:
    """Swap every Linear -> GeLU pair of ``model`` in place for one fused layer; returns how
    many were swapped.

    Finds pairs in ``nn.Sequential`` (a Linear directly followed by a GeLU module) and in
    Hugging Face-style MLP blocks whose ``forward`` feeds one Linear (or HF ``Conv1D``) only
    into a GeLU (``self.act(self.fc(x))`` or the two-line form). The Linear becomes a
    :class:`FusedLinearGeLU` sharing its parameters (a ``Conv1D`` keeps its (in, out)
    layout), the GeLU an identity. Everything else (other activations, Linear subclasses,
    layers used twice) is left alone; outputs change only by the dtype's rounding.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse needs an nn.Module, got {type(model).__name__}")
    count = 0
    for m in list(model.modules()):
        if isinstance(m, (FusedLinearGeLU, _FusedConv1DGeLU)):
            continue
        if isinstance(m, nn.Sequential):
            count += _fuse_sequential(m)
        elif type(m).forward is not nn.Module.forward:
            count += _fuse_block(m)
    return count
