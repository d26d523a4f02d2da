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

import math

import torch
from torch import nn

from distllm.nn.fuse_graph import Pair, block_pairs, fusable_linear, gelu_approximate
from distllm.ops.linear_gelu import linear_gelu

__all__ = ["FusedLinearGeLU", "fuse", "gelu_approximate"]


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

    def borrowed_parameters(self) -> list[nn.Parameter]:
        """The second Linear's parameters, read here though its slot holds them: what shards
        or gathers parameters per layer (ZeRO, :func:`distllm.parallel.data.zero3.borrowed`)
        has them ready for this module's forward."""
        return [p for p in (self._tail.weight, self._tail.bias) if p is not None]

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
    if fusable_linear(fc) == "linear":
        return FusedLinearGeLU.from_linear(fc, approximate)
    return _FusedConv1DGeLU(fc, approximate)


def _identity(x):
    return x


def _replacements(block: nn.Module, pairs: list[Pair]) -> dict[str, object]:
    """Child name -> what takes its place, for ``pairs`` of ``block``; builds every new module
    (which may raise) without touching ``block``."""
    new: dict[str, object] = {}
    for fc_name, act_name, ap, fc2_name in pairs:
        if fc2_name is not None:
            new[fc_name], new[fc2_name] = _fused_mlp(
                getattr(block, fc_name), getattr(block, fc2_name), ap)
        else:
            new[fc_name] = _fused(getattr(block, fc_name), ap)
        # a GeLU module becomes nn.Identity, a GeLU function attribute the identity function
        is_module = isinstance(getattr(block, act_name), nn.Module)
        new[act_name] = nn.Identity() if is_module else _identity
    return new


def _apply(block: nn.Module, new: dict[str, object]) -> None:
    for name, value in new.items():
        if isinstance(value, nn.Module):
            setattr(block, name, value)
        else:
            object.__setattr__(block, name, value)


def fuse(model: nn.Module, *, mlp: bool = True) -> int:
    """Swap every Linear -> GeLU pair of ``model`` in place for one fused layer; returns how
    many were swapped.

    Reads the pairs from each block's graph (:mod:`distllm.nn.fuse_graph`): every module
    whose children include a Linear (or Hugging Face ``Conv1D``) and a GeLU (a module, or a
    GeLU function stored as an attribute) is traced with ``torch.fx``, its children kept
    whole, and a Linear whose output feeds only a GeLU, each called once, is a pair. This
    covers ``nn.Sequential`` and Hugging Face MLP blocks (GPT-2's ``Conv1D``, BERT). The
    Linear becomes a :class:`FusedLinearGeLU` sharing its parameters (a ``Conv1D`` keeps its
    (in, out) layout), the GeLU an identity. When the GeLU's output in turn feeds only a
    child ``nn.Linear`` (a whole MLP), the first Linear's replacement computes the MLP, with
    the backward fused across the two GEMMs, and the second Linear's slot keeps its parameters
    under their names and passes its input through; in a chain (Linear -> GeLU -> Linear ->
    GeLU -> Linear) every GeLU is fused and the last pair takes the Linear after it. A block
    whose ``forward`` has arguments defaulting to None is traced with each of them None and
    given (every combination; more than four such arguments leave the block alone), and only
    the edges found in every trace are fused. Everything else (other
    activations, Linear subclasses, outputs used twice, blocks that cannot be traced) is left
    alone; outputs change only by the dtype's rounding. All replacements are built before
    the model changes, so an error leaves it as it was.

    A whole MLP's fused backward is differentiable once: a second derivative through it (a
    gradient penalty) raises. ``mlp=False`` fuses the pairs alone (each
    :class:`FusedLinearGeLU` is differentiable twice) and leaves the second Linear as it is.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse needs an nn.Module, got {type(model).__name__}")
    plans = []  # every block's replacements are built before any block changes
    for m in list(model.modules()):
        if isinstance(m, (FusedLinearGeLU, _FusedConv1DGeLU, _FusedAway)):
            continue
        if type(m).forward is not nn.Module.forward:
            pairs = block_pairs(m)
            if not mlp:
                pairs = [p._replace(fc2=None) for p in pairs]
            if pairs:
                plans.append((m, pairs, _replacements(m, pairs)))
    for m, _, new in plans:
        _apply(m, new)
    return sum(len(pairs) for _, pairs, _ in plans)
