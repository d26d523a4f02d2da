"""Backends of ``linear_gelu`` on 2-D operands: forward ``(x, w, b) -> (y, pre)`` and backward
``(grad, x, w, pre) -> (dx, dw, db)``, plus which backend can serve which inputs and why not.

- ``cuda``: cuBLASLt epilogues from ``distllm._cuda`` (GELU_AUX_BIAS forward; backward: the
  GeLU-derivative kernel of ``bias_gelu_backward``, then the weight-gradient GEMM with the
  BGRADB epilogue, which also yields the bias gradient). tanh GeLU only. float32 operands use
  TF32 where torch's matmul switch allows it (:func:`distllm.comm.compat.tf32_matmul_allowed`).
  When cuBLASLt offers no algorithm for the inputs (the op raises ``NotImplementedError``),
  the call runs on the next backend (triton, else reference) and says so once through
  ``logging.getLogger("distllm")``.
  (cuBLASLt's DGELU_BGRAD epilogue, ``distllm._cuda.cublaslt_dgelu_bgrad``, fuses the
  GeLU derivative into a GEMM that produces the incoming gradient, i.e. the data-gradient GEMM
  of the layer that consumes y; this op's backward receives that gradient already computed,
  so it has no GEMM to fuse it into.)
- ``triton``: ``distllm.kernels.linear_gelu`` (GPU; on CPU only through TRITON_INTERPRET=1,
  explicitly, never picked by ``auto``).
- ``cpu``: each GEMM through oneDNN (``mkldnn._linear_pointwise``: with the GeLU post-op when
  the pre-activation is not needed, inference; else with the bias fused, then the GeLU) or
  through torch's own GEMM (``addmm`` with the bias, the GeLU in place when no pre-activation
  is kept; ``mm``), whichever measured faster for that GEMM's shape, dtype and thread count
  (once per process, :mod:`distllm.ops.cpu_gemm`): neither wins everywhere. On one AMD
  EPYC core (float32, torch 2.14) torch's GEMM won the input-gradient GEMM at
  (256, 3072) @ (3072, 768) by 1.8x and oneDNN's GeLU post-op lost by 1.1-1.4x at
  (256..2048, 768..1024) x (2048..4096), while on the machine of the suite's first
  ``linear_gelu`` run the post-op was the faster forward. Backward: one ``gelu_backward``
  pass, the bias gradient, two GEMMs.
- ``reference``: ``F.gelu(F.linear(...))`` and its plain derivative; runs everywhere.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

import distllm.ops.bias_gelu  # noqa: F401 - defines torch.ops.distllm.bias_gelu_backward
from distllm.comm.compat import tf32_matmul_allowed
from distllm.ops import extensions
from distllm.ops.cpu_gemm import mm as cpu_mm
from distllm.ops.cpu_gemm import onednn_linear_ok, onednn_or_torch

log = logging.getLogger("distllm")

BACKENDS = ("cuda", "triton", "cpu", "reference")
_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- availability
@functools.cache
def _triton_module():
    try:
        from distllm.kernels import linear_gelu as k
    except Exception as exc:  # noqa: BLE001 - triton missing or broken: report why
        return None, f"triton import failed ({type(exc).__name__}: {exc})"
    problem = k.interpreter_problem()
    return (None, problem) if problem else (k, "ok")


def _cuda_ext_status() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    ok, why = extensions.status("_cuda")
    if ok and not hasattr(extensions.load("_cuda"), "cublaslt_linear_gelu"):
        return False, "distllm._cuda was built without csrc/cuda/linear_gelu.cu"
    return ok, why


def availability() -> dict[str, str]:
    """Backend -> "ok ..." or the reason it cannot run in this process."""
    out: dict[str, str] = {}
    ok, why = _cuda_ext_status()
    out["cuda"] = (
        "ok: cuBLASLt GELU_AUX_BIAS / BGRADB epilogues; serves approximate='tanh' "
        "only (cuBLASLt's GeLU is the tanh form), 'none' goes to triton"
        if ok
        else f"unavailable: {why}"
    )
    k, why = _triton_module()
    if k is None:
        out["triton"] = f"unavailable: {why}"
    elif k.interpreting():
        out["triton"] = (
            "ok: through TRITON_INTERPRET=1 on CPU (slow; explicit backend='triton' "
            "only, auto never picks it)"
        )
    elif torch.cuda.is_available():
        out["triton"] = "ok: autotuned Triton GEMM with bias+GeLU epilogue"
    else:
        out["triton"] = "unavailable: no CUDA device (set TRITON_INTERPRET=1 to run on CPU)"
    out["cpu"] = (
        "ok: per GEMM shape, oneDNN linear (GeLU post-op in inference, fused bias) or torch "
        "addmm/mm, whichever measured faster here"
        if onednn_linear_ok()
        else "ok: torch addmm + GeLU (oneDNN linear missing)"
    )
    out["reference"] = "ok: F.gelu(F.linear(x, w, b))"
    return out


def why_not(backend: str, x: torch.Tensor, weight: torch.Tensor, approximate: str) -> str | None:
    """None if ``backend`` can serve these inputs, else the reason it cannot."""
    if backend == "reference":
        return None
    if backend == "cpu":
        if x.device.type == "cpu":
            return None
        return f"backend 'cpu' needs CPU tensors, got {x.device}"
    if x.dtype not in _GEMM_DTYPES:
        return f"backend {backend!r} supports float32/bfloat16/float16, got {x.dtype}"
    if backend == "triton":
        k, why = _triton_module()
        if k is None:
            return why
        if k.interpreting():
            return None if x.device.type == "cpu" else "triton runs in the interpreter (CPU only)"
        return None if x.is_cuda else "backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1)"
    if backend == "cuda":
        ok, why = _cuda_ext_status()
        if not ok:
            return why
        if not x.is_cuda:
            return f"backend 'cuda' needs CUDA tensors, got {x.device}"
        if approximate != "tanh":
            return "cuBLASLt's GeLU epilogue is the tanh form: it serves approximate='tanh' only"
        if x.shape[-1] % 8 or weight.shape[0] % 8:
            return "cuBLASLt epilogues need in/out features that are multiples of 8"
        if x.shape[-1] == 0:  # a GEMM with nothing to sum: layouts with a leading dim of 0
            return "cuBLASLt needs in_features > 0 (an empty GEMM: gelu(bias) elsewhere)"
        return None
    return f"unknown backend {backend!r}"


# ----------------------------------------------------------------------------- forward
def fwd(backend: str, x, w, b, approximate: str, save_pre: bool):
    """(y, pre) for 2-D x (M, K), w (N, K); pre is empty((0,)) unless save_pre."""
    if backend == "cuda":
        try:
            return _cublaslt_fwd(x, w, b, save_pre)
        except NotImplementedError as exc:  # cuBLASLt has no algorithm for these inputs
            backend = _after_cuda(x, w, approximate, "forward", exc)
    if backend == "triton":
        k, _ = _triton_module()
        return k.linear_gelu_fwd(x, w, b, approximate, save_pre)
    if backend == "cpu":
        return _cpu_fwd(x, w, b, approximate, save_pre)
    pre = F.linear(x, w, b)  # (M, K) @ (K, N) + b
    y = F.gelu(pre, approximate=approximate)
    return y, (pre if save_pre else pre.new_empty(0))


def _cublaslt_fwd(x, w, b, save_pre: bool):
    """(y, pre) through cuBLASLt's GELU(_AUX)(_BIAS) epilogue."""
    b = None if b is None else _aligned(b)
    kernels = extensions.load("_cuda")
    return kernels.cublaslt_linear_gelu(_aligned(x), _aligned(w), b, save_pre, _tf32())


def _cublaslt_wgrad(gu, x, has_bias: bool):
    """(dw, db): the weight-gradient GEMM with the BGRADB epilogue."""
    return extensions.load("_cuda").cublaslt_wgrad_bgrad(_aligned(gu), _aligned(x), has_bias,
                                                          _tf32())


def _tf32() -> bool:
    """Whether float32 cuBLASLt GEMMs may use TF32 (torch's own matmul switch)."""
    return tf32_matmul_allowed()


_fallback_warned: set[str] = set()


def _after_cuda(x, w, approximate: str, phase: str, exc: Exception) -> str:
    """The backend that runs when cuBLASLt has no algorithm (triton if it can serve these
    inputs, else the reference; in backward, torch's GEMMs). Says so once per phase."""
    nxt = "triton" if why_not("triton", x, w, approximate) is None else "reference"
    instead = "torch's GEMMs for dW and db" if phase == "backward" else f"backend {nxt!r}"
    if phase not in _fallback_warned:
        _fallback_warned.add(phase)
        log.warning(
            "linear_gelu backend 'cuda' (%s): %s; using %s instead",
            phase,
            str(exc).splitlines()[0],
            instead,
        )
    return nxt


def _cpu_fwd(x, w, b, approximate, save_pre):
    def lp(*args):  # looked up only when called: a torch without it never gets here
        return torch.ops.mkldnn._linear_pointwise(*args)

    x, w = x.contiguous(), w.contiguous()
    b = None if b is None else b.contiguous()
    if not save_pre:  # inference: GeLU as oneDNN's post-op, or in place after torch's GEMM
        y = onednn_or_torch(
            f"linear_gelu_{approximate}", x, w,
            lambda: lp(x, w, b, "gelu", [], approximate),
            lambda: torch.ops.aten.gelu_(F.linear(x, w, b), approximate=approximate))
        return y, x.new_empty(0)
    pre = onednn_or_torch("linear", x, w, lambda: lp(x, w, b, "none", [], ""),
                           lambda: F.linear(x, w, b))  # the bias fused into either GEMM
    return F.gelu(pre, approximate=approximate), pre


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with a 16-byte aligned start (cuBLASLt vector loads need it)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ----------------------------------------------------------------------------- backward
# The backward in pieces, so that the tensor-parallel layers can run the input-gradient GEMM
# inside an overlap engine between them: gelu_grad (gu = grad * gelu'(pre), with the bias
# gradient where the backend has it in the same pass), dgrad (gu @ W) and wgrad (gu^T @ x,
# with the bias gradient in cuBLASLt's BGRADB epilogue). gemm_dgelu is the piece the MLP
# uses instead of gelu_grad: the GeLU derivative fused into the GEMM that produces grad.
def gelu_grad(backend: str, grad, pre, has_bias: bool, approximate: str):
    """``(gu, db)``: ``gu = grad * gelu'(pre)``; ``db = gu.sum(0)`` when this backend computes
    it in the same pass (triton), else None (the caller takes it from :func:`wgrad`)."""
    grad = grad.contiguous()
    if backend == "triton":
        k, _ = _triton_module()
        return k.gelu_bwd_pass(grad, pre, has_bias, approximate)  # one fused pass
    if backend == "cuda":
        return torch.ops.distllm.bias_gelu_backward(grad, pre, None, approximate), None
    return torch.ops.aten.gelu_backward(grad, pre, approximate=approximate), None


def wgrad(backend: str, gu, x, has_bias: bool):
    """``(dw, db)``: ``dw = gu^T @ x`` (N, K) and, if ``has_bias``, ``db = gu.sum(0)``."""
    if backend == "cuda":  # dW GEMM with the bias gradient in its BGRADB epilogue
        try:
            return _cublaslt_wgrad(gu, x, has_bias)
        except NotImplementedError as exc:  # no algorithm: the plain GEMMs below
            _after_cuda(x, gu, "tanh", "backward", exc)
    return gu.t() @ x, (gu.sum(0) if has_bias else None)  # (N, M) @ (M, K)


def dgrad(backend: str, gu, w):
    """``dx = gu @ w``: (M, N) @ (N, K); on the cpu backend through oneDNN or torch's GEMM,
    whichever measured faster (:func:`distllm.ops.cpu_gemm.mm`)."""
    return cpu_mm(gu, w) if backend == "cpu" else gu @ w


def gemm_dgelu(backend: str, dy, w2, pre, has_bias: bool, approximate: str):
    """``(gu, db)`` with ``gu = (dy @ w2) * gelu'(pre)`` for ``dy`` (M, P), ``w2`` (P, N) (the
    weight of the layer that consumed ``y = gelu(pre)``), ``pre`` (M, N); ``db = gu.sum(0)``
    if ``has_bias`` else None.

    - ``cuda``: one cuBLASLt GEMM with the DGELU_BGRAD epilogue (gu and db in the epilogue);
    - ``triton``: one Triton GEMM whose epilogue applies gelu'(pre) and writes db's partial
      column sums (``distllm.kernels.linear_gelu.gemm_dgelu``);
    - ``cpu`` / ``reference``: the GEMM (``cpu``: through oneDNN or torch's, whichever
      measured faster, :func:`distllm.ops.cpu_gemm.mm`), then one pass applying gelu' in
      place. On CPU the
      GEMM dominates (measured at (2048, 1024) @ (1024, 2048), fp32, one thread: GEMM 95 ms,
      the gelu' pass 4 ms, the column sum 2 ms); computing the GEMM in row blocks small
      enough for the pass to find them in L2 cost more in GEMM efficiency (104-132 ms for
      blocks of 256-64 rows) than the pass saves, so this is the cheapest correct path.
    """
    dy = dy.contiguous()
    if backend == "cuda":
        try:
            kernels = extensions.load("_cuda")
            gu, db = kernels.cublaslt_dgelu_bgrad(_aligned(dy), _aligned(w2), _aligned(pre),
                                                  _tf32())
            return gu, (db if has_bias else None)
        except NotImplementedError as exc:  # no algorithm: the next backend
            backend = _after_cuda(dy, w2.t(), approximate, "fused MLP backward", exc)
    if backend == "triton":
        k, _ = _triton_module()
        return k.gemm_dgelu(dy, w2, pre, has_bias, approximate)
    g = cpu_mm(dy, w2) if backend == "cpu" else dy @ w2  # (M, P) @ (P, N)
    gu = torch.ops.aten.gelu_backward.grad_input(g, pre, approximate=approximate, grad_input=g)
    return gu, (gu.sum(0) if has_bias else None)


def bwd(
    backend: str, grad, x, w, pre, has_bias: bool, approximate: str, need_dx: bool, need_dw: bool
):
    """(dx, dw, db) of y = gelu(x w^T + b); a gradient not needed is empty((0,))."""
    gu, db = gelu_grad(backend, grad, pre, has_bias, approximate)
    dw = None
    if need_dw:
        dw, db_w = wgrad(backend, gu, x, has_bias and db is None)
        db = db if db is not None else db_w
    if has_bias and db is None:
        db = gu.sum(0)
    dx = dgrad(backend, gu, w) if need_dx else None

    def empty():  # a fresh tensor per slot: outputs of a custom op must not alias
        return x.new_empty(0)

    return (
        empty() if dx is None else dx,
        empty() if dw is None else dw,
        empty() if db is None else db.to(x.dtype),
    )
