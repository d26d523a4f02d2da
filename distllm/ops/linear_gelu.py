"""``linear_gelu(x, weight, bias=None, *, approximate="none", backend="auto")``:
y = gelu(x @ weight.T + bias) as one differentiable operation.

Registered with ``torch.library`` here, in the order every op of this package follows
(custom ops, fakes, autograd, public function), so that it survives ``torch.compile``:

1. ``distllm::linear_gelu_fwd(x, weight, bias?, approximate, backend, save_pre) -> (y, pre)``
   on 2-D ``x`` (M, K); ``pre`` (the pre-activation, what the backward needs) is an empty
   tensor when ``save_pre`` is false (no gradient is needed); and
   ``distllm::linear_gelu_bwd(grad, x, weight, pre, bias?, approximate, backend, need_dx,
   need_dw) -> (dx, dweight, dbias)``;
   ``distllm::gemm_dgelu(dy, weight, pre, has_bias, approximate, backend) -> (gu, dbias)``,
   the GeLU derivative fused into the data-gradient GEMM of the layer that consumed
   ``y = gelu(pre)`` (the MLP's second GEMM): ``gu = (dy @ weight) * gelu'(pre)``, the
   operand of both of the first GEMM's backward GEMMs (cuBLASLt DGELU_BGRAD, a Triton GEMM
   with that epilogue, or the GEMM and one pass on CPU), with ``dbias = gu.sum(0)``;
2. their fake implementations;
3. the second as the autograd formula of the first;
4. :func:`linear_gelu`, which checks the inputs, applies autocast and reshapes (..., K) to
   (M, K).

Backends (:mod:`distllm.ops.linear_gelu_backends`; ``backends()`` says which run here and
why not): ``cuda`` (cuBLASLt epilogues, ``approximate="tanh"`` only), ``triton``, ``cpu``
(oneDNN) and ``reference`` (plain PyTorch). ``backend="auto"`` picks, per shape (the rows M
rounded up to a power of two, K and N exact), dtype, device and whether a gradient is
needed, the candidate whose whole call (forward, plus backward in training) measured
fastest on first use, the unfused reference among them; under ``torch.compile`` the choice
is made inside the op instead, per phase (see :mod:`distllm.ops.backend_choice`). No
collective runs in forward or backward: in a column-parallel layer this is the local shard's
computation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distllm.dtypes import autocast_cast
from distllm.ops import backend_choice, weight_grad
from distllm.ops import linear_gelu_backends as impl
from distllm.ops.weight_grad import weight_grad_store

__all__ = ["linear_gelu", "linear_gelu_reference", "gemm_dgelu", "backends"]

_APPROX = ("none", "tanh")
_CHOICES = ("auto", *impl.BACKENDS)


# ----------------------------------------------------------------------------- 1. custom ops
@torch.library.custom_op("distllm::linear_gelu_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str,
    backend: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    name = _resolve_fwd(backend, x, weight, bias, approximate, save_pre)
    return impl.fwd(name, x, weight, bias, approximate, save_pre)


@torch.library.custom_op("distllm::linear_gelu_bwd", mutates_args=())
def _bwd_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str,
    backend: str,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if pre.numel() == 0 and x.shape[0] * weight.shape[0] > 0:
        pre = F.linear(x, weight, bias)  # forward ran without save_pre: recompute (M, N)
    has_bias = bias is not None
    name = _resolve_bwd(backend, grad, x, weight, pre, has_bias, approximate, need_dx, need_dw)
    return impl.bwd(name, grad, x, weight, pre, has_bias, approximate, need_dx, need_dw)


@torch.library.custom_op("distllm::gemm_dgelu", mutates_args=())
def _dgelu_op(
    dy: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor,
    has_bias: bool,
    approximate: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    gu, db = impl.gemm_dgelu(backend, dy, weight, pre, has_bias, approximate)
    return gu, (db.to(pre.dtype) if db is not None else pre.new_empty(0))


# ----------------------------------------------------------------------------- 2. fakes
@_fwd_op.register_fake
def _(x, weight, bias, approximate, backend, save_pre):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    return y, (x.new_empty((x.shape[0], weight.shape[0])) if save_pre else x.new_empty(0))


@_bwd_op.register_fake
def _(grad, x, weight, pre, bias, approximate, backend, need_dx, need_dw):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else x.new_empty(0)
    db = x.new_empty((weight.shape[0],)) if bias is not None else x.new_empty(0)
    return dx, dw, db


@_dgelu_op.register_fake
def _(dy, weight, pre, has_bias, approximate, backend):
    return pre.new_empty(pre.shape), pre.new_empty((pre.shape[1],) if has_bias else (0,))


# ----------------------------------------------------------------------------- 3. autograd
def _setup_context(ctx, inputs, output):
    x, weight, bias, approximate, backend, _save_pre = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.approximate = approximate
    ctx.backend = backend
    ctx.mark_non_differentiable(output[1])
    ctx.store, ctx.weight = weight_grad_store(weight), weight  # zb-h1's W, or None


def _backward(ctx, grad_y, _grad_pre):
    x, weight, bias, pre = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    later = need_dw and ctx.store is not None  # zb-h1: the weight's GEMM left to W
    dx, dw, db = torch.ops.distllm.linear_gelu_bwd(
        grad_y, x, weight, pre, bias, ctx.approximate, ctx.backend, need_dx,
        need_dw and not later
    )
    if later:  # W runs the backward's weight half (gelu'(pre) again, elementwise)
        ctx.store.defer((ctx.weight,), lambda: torch.ops.distllm.linear_gelu_bwd(
            grad_y, x, weight, pre, bias, ctx.approximate, ctx.backend, False, True)[1:2])
    return (
        dx if need_dx else None,
        dw if need_dw and not later else None,
        db if (need_db and bias is not None) else None,
        None,
        None,
        None,
    )


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _bwd_setup_context(ctx, inputs, output):
    grad, x, weight, _pre, bias, approximate, _backend, need_dx, need_dw = inputs
    ctx.save_for_backward(grad, x, weight, bias)
    ctx.approximate, ctx.need = approximate, (need_dx, need_dw)


def _used(cot) -> bool:
    """Whether the gradient ``cot`` of a backward output carries anything (an output not
    computed is an empty tensor; one not used, None)."""
    return cot is not None and cot.numel() > 0


def _double_backward(ctx, g_dx, g_dw, g_db):
    """The backward of the backward (a second derivative: a Hessian-vector product, a
    gradient penalty), whatever backend ran the first: the first backward's outputs
    recomputed from (grad, x, weight, bias) in plain torch ops, differentiated once."""
    grad, x, weight, bias = ctx.saved_tensors
    need_dx, need_dw = ctx.need
    with torch.enable_grad():
        ins = [t if t is None else t.detach().requires_grad_() for t in (grad, x, weight, bias)]
        gr, xx, ww, bb = ins
        pre = F.linear(xx, ww, bb)
        gu = torch.autograd.grad(F.gelu(pre, approximate=ctx.approximate), pre, gr,
                                 create_graph=True)[0]
        outs, cots = [], []  # the first backward's outputs that were computed and are used
        if need_dx and _used(g_dx):
            outs.append(gu @ ww)
            cots.append(g_dx)
        if need_dw and _used(g_dw):
            outs.append(gu.t() @ xx)
            cots.append(g_dw)
        if bb is not None and _used(g_db):
            outs.append(gu.sum(0))
            cots.append(g_db)
        leaves = [t for t in ins if t is not None]
        got = (torch.autograd.grad(outs, leaves, cots, allow_unused=True) if outs
               else [None] * len(leaves))
    d_grad, d_x, d_w, *d_b = got  # d_b: [bias's] where there is a bias
    return d_grad, d_x, d_w, None, (d_b or [None])[0], None, None, None, None


_bwd_op.register_autograd(_double_backward, setup_context=_bwd_setup_context)


# ----------------------------------------------------------------------------- 4. public
def linear_gelu_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "none",
) -> torch.Tensor:
    """Plain PyTorch: the oracle of the tests and the last fallback."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def backends() -> dict[str, str]:
    """Each backend name -> ``"ok: ..."`` or ``"unavailable: <reason>"`` in this process."""
    return impl.availability()


def linear_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    approximate: str = "none",
    backend: str = "auto",
) -> torch.Tensor:
    """gelu(x @ weight.T + bias) for ``x`` (..., in), ``weight`` (out, in), ``bias`` (out,).

    Differentiable in x, weight and bias, twice (the second derivative in plain torch ops).
    ``approximate`` as in ``F.gelu``. ``backend``: "auto" (measured per shape and device, the
    rows ``prod(x.shape[:-1])`` rounded up to a power of two), "cuda", "triton", "cpu" or
    "reference"; an explicit backend that cannot serve the inputs raises ValueError naming
    those that can.

    Under ``torch.autocast`` it follows ``F.linear``: floating operands other than float64 are
    cast to the autocast dtype (gradients flow back to the original dtypes).
    """
    device_type = _autocast_device(x)
    if device_type is not None:
        dtype = torch.get_autocast_dtype(device_type)
        x, weight, bias = (autocast_cast(t, device_type, dtype) for t in (x, weight, bias))
        with torch.autocast(device_type, enabled=False):  # the backends see the cast dtypes
            return linear_gelu(x, weight, bias, approximate=approximate, backend=backend)
    _check(x, weight, bias, approximate, backend)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if backend == "auto" and not torch.compiler.is_compiling():
        backend = _choose_end_to_end(x, weight, bias, approximate, needs_grad)
    if backend == "reference":
        return linear_gelu_reference(x, weight, bias, approximate)
    if backend != "auto":
        _require(backend, x, weight, approximate)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])  # (..., K) -> (M, K); a view if layout allows
    y, _ = torch.ops.distllm.linear_gelu_fwd(x2, weight, bias, approximate, backend, needs_grad)
    return y.reshape(*lead, weight.shape[0])


def gemm_dgelu(
    dy: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor,
    *,
    bias_grad: bool = True,
    approximate: str = "none",
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of ``z = linear(gelu(pre), weight)`` into ``pre``, as one GEMM with the
    GeLU derivative in its epilogue: ``gu = (dy @ weight) * gelu'(pre)`` for ``dy``
    (M, out), ``weight`` (out, in) as in ``nn.Linear``, ``pre`` (M, in); also
    ``gu.sum(0)`` (the bias gradient of the layer that produced ``pre``) when
    ``bias_grad``, else None. ``backend`` as :func:`linear_gelu`'s, without "auto" (the
    fused MLP passes the backend its forward resolved). Not differentiable: it is a backward.
    """
    if approximate not in _APPROX:
        raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
    if backend not in impl.BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(impl.BACKENDS)}")
    if dy.dim() != 2 or weight.dim() != 2 or pre.dim() != 2:
        raise ValueError("gemm_dgelu takes 2-D dy (M, out), weight (out, in), pre (M, in); got "
                         f"{tuple(dy.shape)}, {tuple(weight.shape)}, {tuple(pre.shape)}")
    if dy.shape[1] != weight.shape[0] or pre.shape != (dy.shape[0], weight.shape[1]):
        raise ValueError(f"gemm_dgelu: dy {tuple(dy.shape)} @ weight {tuple(weight.shape)} "
                         f"must match pre {tuple(pre.shape)}")
    if not dy.dtype == weight.dtype == pre.dtype:
        raise ValueError(f"gemm_dgelu: dy, weight and pre must share one dtype, got "
                         f"dy={dy.dtype}, weight={weight.dtype}, pre={pre.dtype}")
    _require(backend, pre, weight.t(), approximate)  # N, the GEMM's output features
    _require(backend, dy, weight, approximate)  # P, its reduction (cuBLASLt: a multiple of 8)
    gu, db = torch.ops.distllm.gemm_dgelu(dy, weight, pre, bias_grad, approximate, backend)
    return gu, (db if bias_grad else None)


def _autocast_device(x) -> str | None:
    """The device type whose autocast is on for ``x``, else None."""
    if not isinstance(x, torch.Tensor) or x.device.type not in ("cpu", "cuda"):
        return None
    return x.device.type if torch.is_autocast_enabled(x.device.type) else None


def _check(x, weight, bias, approximate: str, backend: str) -> None:
    if approximate not in _APPROX:
        raise ValueError(f"approximate={approximate!r}: use 'none' (erf) or 'tanh'")
    if backend not in _CHOICES:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(_CHOICES)}")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("linear_gelu: x and weight must be tensors")
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dimension ({x.shape[-1] if x.dim() else 'scalar'}) must equal "
            f"weight's in_features ({weight.shape[1]}); weight is (out, in) as in "
            f"nn.Linear, got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"bias must be 1-D of length out_features={weight.shape[0]}, got shape "
            f"{tuple(bias.shape)}"
        )
    ts = [("x", x), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    if len({t.dtype for _, t in ts}) > 1:
        raise ValueError(
            "x, weight and bias must share one dtype, got "
            + ", ".join(f"{n}={t.dtype}" for n, t in ts)
        )
    if len({t.device for _, t in ts}) > 1:
        raise ValueError(
            "x, weight and bias must be on one device, got "
            + ", ".join(f"{n}={t.device}" for n, t in ts)
        )
    if not x.is_floating_point():
        raise ValueError(f"linear_gelu needs floating-point tensors, got {x.dtype}")


def _require(backend: str, x, weight, approximate: str) -> None:
    """An explicit backend that cannot serve these inputs is an error naming the ones that can."""
    why = impl.why_not(backend, x, weight, approximate)
    if why is None:
        return
    ok = [b for b in impl.BACKENDS if impl.why_not(b, x, weight, approximate) is None]
    raise ValueError(
        f"backend={backend!r} cannot run here: {why}. Available for these inputs: "
        f"{', '.join(ok)} (or backend='auto')"
    )


# ----------------------------------------------------------------------------- auto
def _auto_candidates(x, w, approximate: str) -> list[str]:
    names = [b for b in impl.BACKENDS if impl.why_not(b, x, w, approximate) is None]
    if x.device.type == "cpu":  # the Triton interpreter is for tests, never a speed choice
        names = [b for b in names if b != "triton"]
    return names


def _plain_saved_tensors():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _choose_end_to_end(x, w, b, approximate: str, needs_grad: bool) -> str:
    """The backend whose whole call is fastest for these shapes, measured once per process
    at the first shape of its key (the rows rounded up to a power of two, the rest exact).

    Each candidate is timed as the user will run it: forward, plus backward when a gradient
    is needed, through the registered op and autograd (whose own overhead is not negligible
    at small shapes), against the unfused reference, which bypasses the op."""
    key = (
        f"linear_gelu|{x.dtype}|{backend_choice.gemm_shape_key(x, w)}|bias={b is not None}"
        f"|{approximate}|grad={needs_grad}"
    )
    hit = backend_choice.lookup(
        key, x.device, usable=lambda n: n in _auto_candidates(x, w, approximate))
    if hit is not None:
        return hit
    names = _auto_candidates(x, w, approximate)

    def run(name: str):
        def call():
            # identity hooks: the timing runs must not register saved tensors with an outer
            # context (activation checkpointing counts them, and its recomputation hits the
            # cached choice and saves fewer), nor leave weight GEMMs to a zb-h1 W pass
            with _plain_saved_tensors(), weight_grad.paused(), \
                    torch.enable_grad() if needs_grad else torch.no_grad():
                xs = x.detach().requires_grad_(needs_grad)
                ws = w.detach().requires_grad_(needs_grad)
                bs = None if b is None else b.detach().requires_grad_(needs_grad)
                y = linear_gelu(xs, ws, bs, approximate=approximate, backend=name)
                if needs_grad:
                    y.backward(torch.ones_like(y))

        return call

    return backend_choice.choose(key, x.device, {n: run(n) for n in names}, grad=needs_grad)


def _resolve_fwd(backend, x, w, b, approximate, save_pre) -> str:
    if backend != "auto":  # (the op called directly: cuBLASLt has no exact GeLU, say)
        _require(backend, x, w, approximate)
        return backend
    names = _auto_candidates(x, w, approximate)
    key = (
        f"linear_gelu_fwd|{x.dtype}|{backend_choice.gemm_shape_key(x, w)}|bias={b is not None}"
        f"|{approximate}|pre={save_pre}"
    )
    fns = {n: (lambda n=n: impl.fwd(n, x, w, b, approximate, save_pre)) for n in names}
    return backend_choice.choose(key, x.device, fns)


def _resolve_bwd(backend, grad, x, w, pre, has_bias, approximate, need_dx, need_dw) -> str:
    if backend != "auto":
        _require(backend, x, w, approximate)
        return backend
    names = _auto_candidates(x, w, approximate)
    key = (
        f"linear_gelu_bwd|{x.dtype}|{backend_choice.gemm_shape_key(x, w)}|bias={has_bias}"
        f"|{approximate}|dx={need_dx}|dw={need_dw}"
    )
    fns = {
        n: (lambda n=n: impl.bwd(n, grad, x, w, pre, has_bias, approximate, need_dx, need_dw))
        for n in names
    }
    return backend_choice.choose(key, x.device, fns)
