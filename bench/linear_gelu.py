"""Benchmark of the fused GEMM + bias + GeLU against unfused PyTorch and the best fused peer.

Cases are (phase, M x K x N, dtype); phases:

- ``fwd``: inference forward (no autograd graph);
- ``fwd_train``: forward that keeps what the backward needs;
- ``bwd``: backward alone (the graph of one forward is replayed with retain_graph);
- ``fwd+bwd``: one training step of the layer.

Variants: ``unfused`` (``F.gelu(F.linear(x, w, b))`` eager), ``fused-auto`` (the measured
choice), ``fused-<backend>`` for each backend of the device (CPU: ``cpu``; CUDA: ``cuda`` and
``triton``; one that cannot serve the case is a row with its reason), the ``peer`` (CPU:
oneDNN's linear with GeLU post-op, ``torch.ops.mkldnn._linear_pointwise``; CUDA:
``torch._addmm_activation(..., use_gelu=True)``, forward only: neither has a backward),
``gemm-only`` (the bare GEMM with bias, a lower bound on time), on CUDA ``gemm-nobias``
(``F.linear`` without bias: the bare cuBLAS GEMM) and, on CPU, the candidate
``cpu-rowblocked`` (the GEMM in row blocks of 256, each block's bias+GeLU applied right after
its GEMM while it is in cache), which lost to oneDNN and is kept for the record.

The CPU backend was chosen with this module: at (M, K, N) = (2048, 1024, 4096) float32 on a
2-core AMD EPYC (single-thread CPU time, 7 interleaved reps, median, machine shared with
other jobs), forward: unfused 239 ms, row-blocked GEMM + epilogue 234 ms, oneDNN GeLU
post-op 186 ms, the ``cpu`` backend (oneDNN) 188 ms. So ``cpu`` is oneDNN and there is no
C++ GEMM kernel in ``csrc/``. Run with ``cfg.extra["linear_gelu_timer"] = "cpu"`` to use
that timer on a busy machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from distllm.bench.harness import BenchConfig, interleaved, row

SUITE = "linear_gelu"
_PRESETS = {
    ("cpu", True): [(256, 256, 1024)],
    ("cpu", False): [(2048, 1024, 4096)],
    ("cuda", True): [(2048, 1024, 4096), (8192, 4096, 16384)],
    ("cuda", False): [(2048, 1024, 4096), (8192, 4096, 16384), (4096, 8192, 28672)],
}
# The fused backends that run on each device (Triton on CPU is its interpreter: a test tool).
_DEVICE_BACKENDS = {"cpu": ("cpu",), "cuda": ("cuda", "triton")}


def _shapes(cfg: BenchConfig) -> list[tuple[int, int, int]]:
    if cfg.shapes and "," in cfg.shapes:
        return [tuple(int(v) for v in s.split(",")) for s in cfg.shapes.split(";") if s.strip()]
    return _PRESETS[(cfg.device, cfg.quick)]


def cases(cfg: BenchConfig) -> list[str]:
    return [",".join(map(str, s)) for s in _shapes(cfg)]


def _dtypes(cfg: BenchConfig) -> list[torch.dtype]:
    first = getattr(torch, cfg.dtype)
    extra = cfg.extra.get("linear_gelu_dtypes")
    if extra:
        return [getattr(torch, d) for d in extra]
    # On CPU the full run reports bfloat16 next to float32 (the float32 target shape).
    if cfg.device == "cpu" and not cfg.quick and first == torch.float32:
        return [first, torch.bfloat16]
    return [first]


def _row_blocked(x, w, b, approximate, block=256):
    """Candidate CPU kernel: GEMM per row block into the output, then bias+GeLU in place on
    that block while it is hot (what a C++ blocked kernel calling at::mm_out per block does;
    the Python loop costs ~10 us per block, under 1% here)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    wt = w.t()
    for i in range(0, x.shape[0], block):
        o = out[i : i + block]
        torch.mm(x[i : i + block], wt, out=o)  # (block, K) @ (K, N)
        if b is not None:
            o += b
        torch.ops.aten.gelu_(o, approximate=approximate)
    return out


def _variants(phase: str, x, w, b, approximate: str, device: str):
    """name -> (callable, role) | (None, reason) for one phase."""
    from distllm.ops import backends, linear_gelu
    from distllm.ops._linear_gelu_impl import why_not

    avail = backends()
    xg, wg, bg = (t.detach().clone().requires_grad_(phase != "fwd") for t in (x, w, b))
    grad = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    out: dict[str, tuple] = {}

    def unfused():
        return F.gelu(F.linear(xg, wg, bg), approximate=approximate)

    def fused(be):
        return lambda: linear_gelu(xg, wg, bg, approximate=approximate, backend=be)

    fwds: dict[str, tuple[Callable | None, str]] = {
        "unfused": (unfused, "unfused"),
        "fused-auto": (fused("auto"), "fused"),
    }
    for be in _DEVICE_BACKENDS[device]:  # a backend for another device is no variant here
        if not avail[be].startswith("ok"):
            fwds[f"fused-{be}"] = (None, avail[be])
            continue
        why = why_not(be, x, w, approximate)  # e.g. cuBLASLt's GeLU is the tanh form only
        fwds[f"fused-{be}"] = (None, why) if why else (fused(be), "fused")
    if phase == "fwd":
        out.update(fwds)
        out.update(_peers(x, w, b, approximate, device))
        return out
    for name, (fn, role) in fwds.items():
        if fn is None:
            out[name] = (None, role)
        elif phase == "fwd_train":
            out[name] = (fn, role)
        elif phase == "fwd+bwd":
            out[name] = (lambda fn=fn: fn().backward(grad), role)
        else:  # bwd: one forward, then replay its backward
            y = fn()
            out[name] = (lambda y=y: y.backward(grad, retain_graph=True), role)
    return out


def _peers(x, w, b, approximate, device):
    out: dict[str, tuple] = {"gemm-only": (lambda: F.linear(x, w, b), "part")}
    if device == "cuda":  # the bare cuBLAS GEMM: the floor of any fused epilogue
        out["gemm-nobias"] = (lambda: F.linear(x, w), "part")
    if device == "cpu":
        lp = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
        if lp is None or x.dtype not in (torch.float32, torch.bfloat16):
            out["peer-onednn-postop"] = (
                None,
                f"torch.ops.mkldnn._linear_pointwise unavailable for {x.dtype}",
            )
        else:
            out["peer-onednn-postop"] = (lambda: lp(x, w, b, "gelu", [], approximate), "peer")
        out["cpu-rowblocked"] = (lambda: _row_blocked(x, w, b, approximate), "fused")
    else:
        use_gelu = approximate == "tanh"  # _addmm_activation's GeLU is cuBLASLt's (tanh)
        out["peer-addmm-activation"] = (
            (lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True), "peer")
            if use_gelu
            else (None, "torch._addmm_activation's GeLU is the tanh form; run approximate=tanh")
        )
    return out


def _cpu_timer(fn) -> float:
    """ms of CPU time of this process for one call: on a machine shared with other jobs the
    wall clock measures the neighbours; with one torch thread (set by ``run``) CPU time is
    the work done. Chosen with ``cfg.extra["linear_gelu_timer"] = "cpu"``; rows say so."""
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1e3


def _flops(phase: str, M: int, K: int, N: int) -> float:
    return {"fwd": 2, "fwd_train": 2, "bwd": 4, "fwd+bwd": 6}[phase] * M * K * N


def _reps(cfg: BenchConfig, M: int, K: int, N: int, device: str) -> int:
    if cfg.reps:
        return cfg.reps
    if device == "cuda":
        return 20
    return 3 if cfg.quick else (7 if M * K * N > 4e9 else 10)


def run(cfg: BenchConfig) -> list[dict]:
    device = cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        return [row(SUITE, "-", "-", status="unavailable", reason="no CUDA device")]
    approximate = cfg.extra.get("approximate", "tanh" if device == "cuda" else "none")
    sync = torch.cuda.synchronize if device == "cuda" else None
    rows: list[dict] = []
    cpu_timer = cfg.extra.get("linear_gelu_timer") == "cpu" and device == "cpu"
    threads = torch.get_num_threads()
    if cpu_timer:
        torch.set_num_threads(1)
    try:
        for shape in _shapes(cfg):
            rows += _run_shape(cfg, shape, approximate, device, sync)
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        r.setdefault("extra", {})
        if isinstance(r["extra"], dict):
            r["extra"]["timer"] = "cpu-time, 1 thread" if cpu_timer else "wall"
    return rows


def _run_shape(cfg, shape, approximate, device, sync) -> list[dict]:
    M, K, N = shape
    rows: list[dict] = []
    for dtype in _dtypes(cfg):
        torch.manual_seed(0)
        x = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) * K**-0.5
        b = torch.randn(N, device=device, dtype=dtype) * 0.1
        for phase in ("fwd", "fwd_train", "bwd", "fwd+bwd"):
            rows += _run_phase(cfg, phase, x, w, b, approximate, device, sync)
    return rows


def _run_phase(cfg, phase, x, w, b, approximate, device, sync) -> list[dict]:
    M, K = x.shape
    N = w.shape[0]
    case = f"{phase} {M}x{K}x{N} {str(x.dtype).removeprefix('torch.')}"
    vs = _variants(phase, x, w, b, approximate, device)
    live = {n: fn for n, (fn, _) in vs.items() if fn is not None}
    ctx = torch.no_grad() if phase == "fwd" else torch.enable_grad()
    with ctx:
        st = interleaved(
            live,
            warmup=1,
            reps=_reps(cfg, M, K, N, device),
            sync=sync,
            timer=_cpu_timer if cfg.extra.get("linear_gelu_timer") == "cpu" else None,
        )
    base = st.get("unfused")
    out = []
    for n, (fn, role_or_reason) in vs.items():
        common = dict(
            device=device,
            dtype=str(x.dtype).removeprefix("torch."),
            shape=f"{M}x{K}x{N}",
            phase=phase,
            approximate=approximate,
        )
        if fn is None:
            out.append(row(SUITE, case, n, status="unavailable", reason=role_or_reason, **common))
            continue
        s = st[n]
        sp = base.median_ms / s.median_ms if base else None
        out.append(
            row(
                SUITE,
                case,
                n,
                s,
                flops=_flops(phase, M, K, N),
                role=role_or_reason,
                speedup_vs_unfused=sp,
                **common,
            )
        )
    return out
