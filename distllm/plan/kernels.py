"""Seconds of the kernels one transformer block runs, from its shapes and the hardware profile.

* GEMMs by shape (:func:`gemm_time`): the output is cut into tiles that run in waves over the
  SMs, so a GEMM whose tile count does not fill its last wave, or whose edges leave tiles
  half empty, runs below the best-shaped GEMM's efficiency; a GEMM that moves more bytes than
  its FLOPs can hide (attention's ``QK^T`` over a small head dimension) is bound by memory
  instead (the roofline). After NVIDIA's "Matrix Multiplication Background User's Guide"
  (tile and wave quantization, arithmetic intensity).
* Memory-bound kernels (:func:`mem_time`): bytes over the achievable memory bandwidth.
* Attention without a fused kernel (:func:`attention_times`): two batched GEMMs per head plus
  the softmax (and dropout) over the ``s x s`` scores, read and written in memory, forward
  and backward; with a fused (flash) kernel: its FLOPs at ``flash_efficiency``, the causal
  half only, backward 2.5x forward (Dao 2023, FlashAttention-2, sec. 3: five matmuls
  against two).
* Elementwise work of a block (:func:`block_elementwise_bytes`): layer norms, residual adds,
  bias + GeLU, bias + dropout + add, the context transpose; backward moves about twice the
  forward bytes (it reads the saved input and the incoming gradient, writes the gradient).
"""

from __future__ import annotations

import math

from .hardware import Profile
from .model import ModelShape

__all__ = [
    "gemm_time",
    "mem_time",
    "linear_gemms",
    "attention_times",
    "block_elementwise_bytes",
    "TILES",
    "CE_BYTES_PER_LOGIT",
]

# output tiles cuBLAS chooses among (it picks the fastest; a smaller tile wastes less of a
# ragged edge and fills more SMs, at about the same per-SM rate for the shapes here)
TILES = ((256, 128), (128, 256), (128, 128))

# bytes moved per logit by the vocab-parallel cross-entropy, forward and backward: cast to
# fp32 (read 2, write 4), max (4), subtract (8), exp (8), sum (4), divide (8); gradient in
# place (8) and cast back (6)
CE_BYTES_PER_LOGIT = 52


def _useful_fraction(m: int, n: int, batch: int, sms: int, tm: int, tn: int) -> float:
    """Fraction of the SM-tile slots of all waves that holds useful output elements."""
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    waves = math.ceil(tiles / sms)
    return (m * n * batch) / (waves * sms * tm * tn)


def gemm_time(prof: Profile, peak: float, m: int, n: int, k: int, batch: int = 1,
              elem: int = 2) -> float:
    """Seconds of ``batch`` GEMMs ``(m, k) @ (k, n)`` at ``peak`` FLOP/s of the dtype."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    g = prof.gemm
    if g is None:
        t_flops = flops / (peak * prof.matmul_efficiency)
    else:
        tiles = ((g.tile_m, g.tile_n),) + TILES
        useful = max(_useful_fraction(m, n, batch, g.sms, tm, tn) for tm, tn in tiles)
        t_flops = flops / (peak * g.max_efficiency * g.shape_fraction * useful)
    t_bytes = mem_time(prof, elem * (m * k + k * n + m * n) * batch)
    return max(t_flops, t_bytes)


def mem_time(prof: Profile, nbytes: float) -> float:
    """Seconds to move ``nbytes`` through device memory (a memory-bound kernel)."""
    return nbytes / (prof.memory_bandwidth * prof.memory_efficiency)


def linear_gemms(shape: ModelShape, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """``(m, n, k)`` of a block's four linear layers in forward, per TP rank: QKV, attention
    output projection, MLP input (two matrices when gated), MLP output."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    gates = 2 if shape.gated_mlp else 1
    return [
        (tokens, (h + 2 * kv) // tp, h),  # (T, h) @ (h, (h + 2kv)/t)
        (tokens, h, h // tp),  # (T, h/t) @ (h/t, h)
        (tokens, gates * f // tp, h),  # (T, h) @ (h, f/t)
        (tokens, h, f // tp),  # (T, f/t) @ (f/t, h)
    ]


def linear_times(prof: Profile, peak: float, shape: ModelShape, tokens: int, tp: int,
                 elem: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a block's linear layers."""
    fwd = dgrad = wgrad = 0.0
    for m, n, k in linear_gemms(shape, tokens, tp):
        fwd += gemm_time(prof, peak, m, n, k, elem=elem)
        dgrad += gemm_time(prof, peak, m, k, n, elem=elem)  # (T, n) @ (n, k)
        wgrad += gemm_time(prof, peak, k, n, m, elem=elem)  # (k, T) @ (T, n)
    return fwd, dgrad, wgrad


def attention_times(prof: Profile, peak: float, shape: ModelShape, b: int, tp: int,
                    elem: int, flash: bool, causal_skip: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one block, per TP rank.

    ``causal_skip``: a fused kernel skips the masked upper triangle (half the work).
    """
    s, d = shape.seq_len, shape.head_dim
    heads = b * shape.heads // tp  # (b * a/t) independent (s, d) problems
    if flash:
        flops = 4.0 * heads * s * s * d * (0.5 if causal_skip else 1.0)
        rate = peak * (prof.flash_efficiency or prof.matmul_efficiency)
        return flops / rate, 2.5 * flops / rate
    qk = gemm_time(prof, peak, s, s, d, heads, elem)  # (s, d) @ (d, s)
    pv = gemm_time(prof, peak, s, d, s, heads, elem)  # (s, s) @ (s, d)
    scores = heads * s * s
    drop = 1 if shape.dropout else 0
    # fused scale + mask + softmax: read and write the scores; dropout: read, write, a mask
    soft_f = mem_time(prof, scores * (2 * elem + drop * (2 * elem + 1)))
    # softmax backward reads y and dy, writes dx; dropout backward reads dy and the mask
    soft_b = mem_time(prof, scores * (3 * elem + drop * (2 * elem + 1)))
    # backward: dP = dO V^T and dS^T Q are (s, s, d)-shaped, dV and dQ are (s, d, s)
    bwd = gemm_time(prof, peak, s, s, d, heads, elem) + gemm_time(prof, peak, s, d, s, heads, elem)
    bwd += 2 * gemm_time(prof, peak, s, d, s, heads, elem)
    return qk + pv + soft_f, bwd + soft_b


def block_elementwise_bytes(shape: ModelShape, tokens: int, tp: int, sp: bool,
                            elem: int, gelu: bool = True) -> float:
    """Bytes the memory-bound kernels of one block's forward move, per TP rank.

    Two layer norms (read and write the ``(T, h)`` stream, 4 passes), two bias + dropout +
    residual adds (read output, residual, write: 6 passes; dropout adds a byte mask per
    element), the context transpose ``(b, a/t, s, d) -> (T, h/t)`` (2 passes of ``h/t``),
    bias + GeLU over the MLP's inner activation (read, write; a gated MLP reads two).
    With sequence parallelism the norms and residual adds work on ``T/t`` rows.
    ``gelu=False``: without the GeLU's bytes (a profile that times it per element).
    """
    n = tokens * shape.hidden  # elements of the residual stream
    repl = n / tp if sp else n
    drop = 1 if shape.dropout else 0
    inner = tokens * shape.ffn / tp
    stream = repl * (10 * elem + 2 * drop)
    context = 2 * elem * n / tp
    act = (3 if shape.gated_mlp else 2) * elem * inner if gelu else 0.0
    return stream + context + act
