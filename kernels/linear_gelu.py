"""Triton kernels of linear + bias + GeLU, forward and backward.

Math (u is the pre-activation, u = x @ W^T + b):

- exact (``approximate="none"``): gelu(u) = u * Phi(u), Phi(u) = (1 + erf(u / sqrt 2)) / 2,
  gelu'(u) = Phi(u) + u * phi(u), phi(u) = exp(-u^2 / 2) / sqrt(2 pi);
- tanh: gelu(u) = u/2 * (1 + t), t = tanh(k0 (u + k1 u^3)), k0 = sqrt(2/pi), k1 = 0.044715,
  gelu'(u) = (1 + t)/2 + u/2 (1 - t^2) k0 (1 + 3 k1 u^2).

Forward (``_fwd_kernel``): a tiled GEMM y(M, N) = gelu(x(M, K) @ W(N, K)^T + b), one program
per (BLOCK_M, BLOCK_N) output tile, tiles visited in GROUP_M-row super-groups so that
consecutive programs share W tiles in L2. The fp32 accumulator gets the bias and the GeLU in
the epilogue; the pre-activation u is stored next to y when the backward will need it
(recomputing it would cost a second GEMM, storing it costs one extra write of M*N elements).

Backward (``_bwd_kernel``): one pass over (M, N) that reads the incoming gradient g and u,
writes gu = g * gelu'(u) (the operand of both backward GEMMs) and, in the same pass, the
partial column sums of gu that give the bias gradient (one fp32 row per BLOCK_M row-block,
summed afterwards; no atomics, so the result is deterministic). The two GEMMs
dx = gu @ W and dW = gu^T @ x then run on the vendor BLAS: fusing the GeLU derivative
into their operand loads instead would recompute it (erf, exp) once per output tile column
of each GEMM, i.e. K / BLOCK_K times per element, and read two operands instead of one.

The MLP's backward (``_dgelu_kernel``, :func:`gemm_dgelu`) does fuse the GeLU derivative into
a GEMM: the one that *produces* the incoming gradient, the second Linear's input-gradient
GEMM ``dy @ W2`` (M, N), whose epilogue reads u once per output element, writes
gu = (dy @ W2) * gelu'(u) and the per-row-block partial column sums of gu (the first
Linear's bias gradient): the (M, N) gradient never makes a round trip through memory before
the GeLU derivative is applied (cuBLASLt's DGELU_BGRAD does the same on the CUDA backend).

Under ``TRITON_INTERPRET=1`` the kernels run on CPU (slowly) with one small fixed
configuration; on a GPU they are autotuned over configurations for Ampere and Hopper.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from distllm.kernels import linear_gelu_tuning as tuning
from distllm.kernels.linear_gelu_tuning import aot_variants  # noqa: F401 - read by kernels.aot

from distllm.comm.compat import tf32_matmul_allowed

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The token count and its power-of-two bucket (the autotuner's key) are plain i32 arguments:
# Triton would otherwise compile one binary for M = 1, one for M divisible by 16 and one for
# the rest, per tuning config, and none of the three is faster (M bounds masks only).
_TOKEN_ARGS = ["M", "M_BUCKET"]

# The GeLU constants are literals inside the jitted helpers below: a plain module float read
# in @triton.jit code compiles nowhere (the compiler accepts only constexpr globals, which
# the interpreter in turn mishandles in arithmetic); tests/ops/test_triton_compile.py
# compiles every kernel for sm_80 and sm_90.


@triton.jit
def _tanh(z):
    # tanh(z) = 1 - 2 / (exp(2z) + 1); saturates correctly for large |z| in fp32.
    z = tl.minimum(tl.maximum(z, -20.0), 20.0)  # tanh(20) == 1 in fp32; avoids exp overflow
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _tanh_arg(u):
    # a(u) = k0 (u + k1 u^3), k0 = sqrt(2 / pi), k1 = 0.044715
    return 0.7978845608028654 * (u + 0.044715 * u * u * u)


@triton.jit
def _tanh_arg_grad(u):
    # a'(u) = k0 (1 + 3 k1 u^2)
    return 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * u * u)


@triton.jit
def _cdf(u):
    # Phi(u) = (1 + erf(u / sqrt 2)) / 2; 0.7071067811865476 = 1 / sqrt 2
    return 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))


@triton.jit
def _gelu(u, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        out = 0.5 * u * (1.0 + _tanh(_tanh_arg(u)))
    else:
        out = u * _cdf(u)
    return out


@triton.jit
def _gelu_grad(u, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        t = _tanh(_tanh_arg(u))
        d = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _tanh_arg_grad(u)
    else:
        # phi(u) = exp(-u^2 / 2) / sqrt(2 pi); 0.3989422804014327 = 1 / sqrt(2 pi)
        d = _cdf(u) + u * tl.exp(-0.5 * u * u) * 0.3989422804014327
    return d


@triton.jit
def _tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(rows, cols, row-tile index)`` of this program's output tile, rows and columns in
    int64 (M*N and N*K may pass 2^31), tiles visited in grouped order: GROUP_M row-tiles
    share each column-tile of the second operand while it sits in L2."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return rm, rn, pid_m


@triton.jit
def _tile_matmul(
    a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
    ALLOW_TF32: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The fp32 (BLOCK_M, BLOCK_N) tile ``A[rm, :] @ B[:, rn]`` of ``A`` (M, K) and ``B``
    (K, N), each read through its element strides (``stride_bn`` / ``stride_bk``: B's
    strides along N and K; for the forward B = W^T, W being (N, K)). Offsets along K are
    int64 too: a K-stride of 2^25 or more (a column-major operand of 2^25 rows) times
    BLOCK_K passes 2^31.

    fp32 operands take TF32 exactly when ``ALLOW_TF32`` (torch's switch) says so: the
    precision is passed to ``tl.dot``, so Triton's own default (``TRITON_F32_DEFAULT``)
    cannot change it. 16-bit operands are multiplied exactly whatever the precision."""
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None] * stride_am  # (BM, 1)
    b_cols = b_ptr + rn[None, :] * stride_bn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        kk = kk.to(tl.int64)
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=(rm[:, None] < M) & k_ok[None, :],
                    other=0.0)  # (BM, BK)
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_ok[:, None] & (rn[None, :] < N),
                    other=0.0)  # (BK, BN)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong; bf16 x bf16 is exact in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ALLOW_TF32:
            acc = tl.dot(a, b, acc, input_precision="tf32")  # (BM, BK) @ (BK, BN)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=_TOKEN_ARGS)
def _fwd_kernel(
    x_ptr,  # (M, K) input rows, any strides
    w_ptr,  # (N, K) weight, nn.Linear layout, any strides
    b_ptr,  # (N,) bias, contiguous; unused when HAS_BIAS is false
    y_ptr,  # (M, N) output gelu(u)
    u_ptr,  # (M, N) pre-activation u, same strides as y; unused when SAVE_PRE is false
    M,
    N,
    K,
    stride_xm,
    stride_xk,  # element strides of x along M and K
    stride_wn,
    stride_wk,  # element strides of W along N and K
    stride_ym,
    stride_yn,  # element strides of y (and u) along M and N
    M_BUCKET,  # next power of two of M: the autotuner's key, not read by the kernel
    HAS_BIAS: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    rm, rn, _ = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_matmul(x_ptr, w_ptr, rm, rn, M, N, K, stride_xm, stride_xk, stride_wn,
                       stride_wk, ALLOW_TF32, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)

    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * stride_ym + rn[None, :] * stride_yn
    if SAVE_PRE:
        tl.store(u_ptr + offs, acc.to(u_ptr.dtype.element_ty), mask=out_mask)
    y = _gelu(acc, APPROX_TANH)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=_TOKEN_ARGS)
def _dgelu_kernel(
    dy_ptr,  # (M, K) gradient of the next layer's output, any strides
    w_ptr,  # (K, N) that layer's weight (nn.Linear layout (out=K, in=N)), any strides
    u_ptr,  # (M, N) pre-activation saved by the forward, contiguous
    gu_ptr,  # (M, N) output dL/du = (dy @ w) * gelu'(u), contiguous
    db_ptr,  # (cdiv(M, BLOCK_M), N) fp32 partial bias gradients; unused unless HAS_BIAS
    M,
    N,
    K,
    stride_dm,
    stride_dk,  # element strides of dy along M and K
    stride_wk,
    stride_wn,  # element strides of w along K and N
    M_BUCKET,  # next power of two of M: the autotuner's key, not read by the kernel
    HAS_BIAS: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    rm, rn, pid_m = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_matmul(dy_ptr, w_ptr, rm, rn, M, N, K, stride_dm, stride_dk, stride_wn,
                       stride_wk, ALLOW_TF32, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gu = acc * _gelu_grad(u, APPROX_TANH)  # masked rows: acc = 0 -> gu = 0
    gu_out = gu.to(gu_ptr.dtype.element_ty)
    tl.store(gu_ptr + offs, gu_out, mask=mask)
    if HAS_BIAS:  # the rounded gu is summed, as the GEMMs that consume it see it
        part = tl.sum(gu_out.to(tl.float32), axis=0)  # (BLOCK_N,)
        tl.store(db_ptr + pid_m.to(tl.int64) * N + rn, part, mask=rn < N)


@triton.jit(do_not_specialize=["M"])
def _bwd_kernel(
    g_ptr,  # (M, N) incoming gradient dL/dy, contiguous
    u_ptr,  # (M, N) pre-activation saved by the forward, contiguous
    gu_ptr,  # (M, N) output dL/du = g * gelu'(u), contiguous
    db_ptr,  # (cdiv(M, BLOCK_M), N) fp32 partial bias gradients; unused unless HAS_BIAS
    M,
    N,
    HAS_BIAS: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: M*N may pass 2^31
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gu = g * _gelu_grad(u, APPROX_TANH)  # masked lanes: g = 0 -> gu = 0
    tl.store(gu_ptr + offs, gu.to(gu_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        # db[n] = sum_m gu[m, n]; the rounded gu is summed, as the GEMMs see it.
        part = tl.sum(gu.to(gu_ptr.dtype.element_ty).to(tl.float32), axis=0)  # (BLOCK_N,)
        tl.store(db_ptr + pid_m.to(tl.int64) * N + rn, part, mask=rn < N)


_BWD_META = {"BLOCK_M": 16, "BLOCK_N": 64} if _INTERPRET else tuning.BWD_META

if _INTERPRET:
    _fwd = _fwd_kernel
    _dgelu = _dgelu_kernel
    _FWD_META = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
else:  # pragma: no cover - needs a GPU
    # DISTLLM_TRITON_TUNE=min: the last (smallest) configuration only, no tuning runs (the
    # GPU tests: one compile per specialization instead of one per configuration).
    _TUNE = os.environ.get("DISTLLM_TRITON_TUNE", "full")
    if _TUNE not in ("full", "min"):
        raise ValueError(f"DISTLLM_TRITON_TUNE={_TUNE!r}: use 'full' (default) or 'min'")
    _fwd = triton.autotune(
        configs=tuning.fwd_configs()[-1:] if _TUNE == "min" else tuning.fwd_configs(),
        # M_BUCKET, not M: a new token count reuses the tuning of its power-of-two bucket
        key=["M_BUCKET", "N", "K", "HAS_BIAS", "SAVE_PRE", "APPROX_TANH", "ALLOW_TF32"],
        prune_configs_by={"early_config_prune": tuning.prune_for_launch},
    )(_fwd_kernel)
    _FWD_META = {}
    _dgelu = triton.autotune(
        configs=tuning.dgelu_configs()[-1:] if _TUNE == "min" else tuning.dgelu_configs(),
        key=["M_BUCKET", "N", "K", "HAS_BIAS", "APPROX_TANH", "ALLOW_TF32"],
        prune_configs_by={"early_config_prune": tuning.prune_for_launch},
        reset_to_zero=["db_ptr"],
    )(_dgelu_kernel)


def interpreter_problem() -> str | None:
    """Why this process's Triton interpreter cannot run the kernels, or None.

    Triton 3.6's interpreter converts a loop bound with ``int()`` of a one-element array,
    which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); Triton 3.8's squeezes it first. The kernels are not at fault, and the
    compiler (GPU) path is unaffected.
    """
    if not _INTERPRET:
        return None
    import numpy as np

    def version(v: str) -> tuple[int, int]:
        major, minor = v.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)

    if version(triton.__version__) < (3, 8) and version(np.__version__) >= (2, 4):
        return (
            f"the Triton {triton.__version__} interpreter cannot run with numpy "
            f"{np.__version__}: install numpy<2.4 (or triton>=3.8) to use TRITON_INTERPRET=1"
        )
    return None


def interpreting() -> bool:
    """Whether Triton runs through its CPU interpreter in this process."""
    return _INTERPRET


def _on(t: torch.Tensor):
    """The device context of a launch: Triton launches on the current CUDA device (and its
    current stream), which need not be the tensors' device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _dot_flags(dtype: torch.dtype) -> dict[str, bool]:
    """The GEMM kernels' dot flags: TF32 for float32 where torch's matmul switch allows it
    (compiled only), and bf16 dots in fp32 under the interpreter (its bf16 dot is wrong)."""
    return {
        "ALLOW_TF32": dtype == torch.float32
        and tf32_matmul_allowed()
        and not _INTERPRET,
        "DOT_FP32": _INTERPRET and dtype == torch.bfloat16,
    }


def linear_gelu_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = gelu(x @ weight^T + bias) for 2-D ``x`` (M, K) and ``weight`` (N, K).

    Returns ``(y, u)`` with ``u`` the pre-activation when ``save_pre`` else an empty tensor.
    """
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    u = torch.empty((M, N) if save_pre else (0,), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y, u
    if K == 0:  # the GEMM is empty: u = bias (or 0)
        pre = (bias if bias is not None else y.new_zeros(N)).expand(M, N)
        y.copy_(torch.nn.functional.gelu(pre.float(), approximate=approximate))
        if save_pre:
            u.copy_(pre)
        return y, u
    # the kernel reads the bias with unit stride (b_ptr + n): a strided view is copied
    bias_arg = bias.contiguous() if bias is not None else y  # never read unless HAS_BIAS
    u_arg = u if save_pre else y  # never written when SAVE_PRE is false

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    with _on(x):
        _fwd[grid](
            x,
            weight,
            bias_arg,
            y,
            u_arg,
            M,
            N,
            K,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            y.stride(0),
            y.stride(1),
            triton.next_power_of_2(M),
            HAS_BIAS=bias is not None,
            SAVE_PRE=save_pre,
            APPROX_TANH=approximate == "tanh",
            **_dot_flags(x.dtype),
            **_FWD_META,
        )
    return y, u


def gelu_bwd_pass(
    grad: torch.Tensor, pre: torch.Tensor, has_bias: bool, approximate: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over (M, N): ``gu = grad * gelu'(pre)`` and, if ``has_bias``, ``gu.sum(0)``."""
    grad = grad.contiguous()
    pre = pre.contiguous()
    M, N = pre.shape
    gu = torch.empty_like(pre)
    bm, bn = _BWD_META["BLOCK_M"], _BWD_META["BLOCK_N"]
    parts = torch.empty(
        (triton.cdiv(M, bm), N) if has_bias else (1,), device=pre.device, dtype=torch.float32
    )
    if M == 0 or N == 0:
        return gu, (torch.zeros(N, device=pre.device, dtype=pre.dtype) if has_bias else None)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    with _on(pre):
        _bwd_kernel[grid](
            grad,
            pre,
            gu,
            parts,
            M,
            N,
            HAS_BIAS=has_bias,
            APPROX_TANH=approximate == "tanh",
            BLOCK_M=bm,
            BLOCK_N=bn,
            **({} if _INTERPRET else tuning.BWD_LAUNCH),
        )
    db = parts.sum(0).to(pre.dtype) if has_bias else None
    return gu, db


def gemm_dgelu(
    dy: torch.Tensor, w: torch.Tensor, pre: torch.Tensor, has_bias: bool, approximate: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gu = (dy @ w) * gelu'(pre)`` for ``dy`` (M, K), ``w`` (K, N), ``pre`` (M, N) in one
    kernel (the GeLU derivative in the GEMM's epilogue), and ``gu.sum(0)`` if ``has_bias``
    (per-row-block partial sums written by the same kernel, then summed: deterministic)."""
    pre = pre.contiguous()
    M, K = dy.shape
    N = w.shape[1]
    gu = torch.empty((M, N), device=dy.device, dtype=dy.dtype)
    if M == 0 or N == 0 or K == 0:
        gu.zero_()
        return gu, (gu.sum(0) if has_bias else None)
    # one fp32 row of partial column sums per row-block of the smallest tile any config
    # uses; rows a larger tile leaves unwritten stay zero (the autotuner zeroes the buffer
    # before each timing run and before the real one: reset_to_zero)
    bm_min = _FWD_META["BLOCK_M"] if _INTERPRET else tuning.min_block_m(tuning.dgelu_configs())
    parts = torch.zeros(
        (triton.cdiv(M, bm_min), N) if has_bias else (1,), device=dy.device, dtype=torch.float32
    )

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    with _on(dy):
        _dgelu[grid](
            dy,
            w,
            pre,
            gu,
            parts,
            M,
            N,
            K,
            dy.stride(0),
            dy.stride(1),
            w.stride(0),
            w.stride(1),
            triton.next_power_of_2(M),
            HAS_BIAS=has_bias,
            APPROX_TANH=approximate == "tanh",
            **_dot_flags(dy.dtype),
            **_FWD_META,
        )
    db = parts.sum(0).to(dy.dtype) if has_bias else None
    return gu, db
