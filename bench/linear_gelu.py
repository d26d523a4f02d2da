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

The CPU backend was chosen with this module at (M, K, N) = (2048, 1024, 4096) float32: the
row-blocked GEMM + epilogue gained nothing over unfused while oneDNN's GeLU post-op did, so
there is no C++ GEMM kernel in ``csrc/`` (figures in
``bench/results/cpu-linear-gelu-2048x1024x4096-20261129/``). On another CPU oneDNN lost to
torch's own GEMM by up to 1.8x, so ``cpu`` runs each GEMM through whichever of the two
measured faster for its shape on the machine at hand. Run with
``cfg.extra["linear_gelu_timer"] = "cpu"`` to time CPU time of one thread on a busy machine.

One case per (phase, shape, dtype); ``cfg.extra`` may set ``approximate`` and
``linear_gelu_dtypes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from distllm.bench.harness import BenchConfig, Case, Result, Setup, shapes
from distllm.bench.rows import row

from distllm.diagnostics.timing import process_time_timer, wall_timer

SUITE = "linear_gelu"
PRESETS = {
    ("cpu", True): [(256, 256, 1024)],
    ("cpu", False): [(2048, 1024, 4096)],
    ("cuda", True): [(2048, 1024, 4096), (8192, 4096, 16384)],
    ("cuda", False): [(2048, 1024, 4096), (8192, 4096, 16384), (4096, 8192, 28672)],
}
# The fused backends that run on each device (Triton on CPU is its interpreter: a test tool).
_DEVICE_BACKENDS = {"cpu": ("cpu",), "cuda": ("cuda", "triton")}
PHASES = ("fwd", "fwd_train", "bwd", "fwd+bwd")


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
    from distllm.ops.linear_gelu_backends import why_not

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


def _flops(phase: str, M: int, K: int, N: int) -> float:
    return {"fwd": 2, "fwd_train": 2, "bwd": 4, "fwd+bwd": 6}[phase] * M * K * N


def _reps(cfg: BenchConfig, M: int, K: int, N: int, device: str) -> int:
    if cfg.reps:
        return cfg.reps
    if device == "cuda":
        return 20
    return 3 if cfg.quick else (7 if M * K * N > 4e9 else 10)


def _cpu_timer(cfg: BenchConfig) -> bool:
    """Whether to time CPU time of one thread (``cfg.extra["linear_gelu_timer"] = "cpu"``)."""
    return cfg.extra.get("linear_gelu_timer") == "cpu" and cfg.device == "cpu"


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return [Case("-", skip="no CUDA device")]
    return [Case(f"{phase} {M}x{K}x{N} {str(dtype).removeprefix('torch.')}",
                 {"phase": phase, "shape": (M, K, N), "dtype": dtype})
            for M, K, N in shapes(cfg, PRESETS[(cfg.device, cfg.quick)])
            for dtype in _dtypes(cfg) for phase in PHASES]


def setup(cfg: BenchConfig, case: Case) -> Setup:
    """The variants of one phase on ``x`` (M, K), ``w`` (N, K), ``b`` (N,), seeded alike for
    every phase of a shape; the forward phase runs without autograd."""
    device, phase, (M, K, N) = cfg.device, case.params["phase"], case.params["shape"]
    dtype = case.params["dtype"]
    threads = torch.get_num_threads()
    if _cpu_timer(cfg):
        torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) * K**-0.5
    b = torch.randn(N, device=device, dtype=dtype) * 0.1
    vs = _variants(phase, x, w, b, _approximate(cfg), device)
    grad = torch.no_grad if phase == "fwd" else contextlib.nullcontext

    def under_grad_mode(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with grad():
                return fn()

        return call

    sync = torch.cuda.synchronize if device == "cuda" else None
    return Setup({n: under_grad_mode(fn) for n, (fn, _) in vs.items() if fn is not None},
                 {n: why for n, (fn, why) in vs.items() if fn is None}, warmup=1,
                 reps=_reps(cfg, M, K, N, device),
                 timer=process_time_timer if _cpu_timer(cfg) else wall_timer(sync),
                 finish=lambda stats: {n: role for n, (fn, role) in vs.items()},
                 close=lambda: torch.set_num_threads(threads))


def _approximate(cfg: BenchConfig) -> str:
    return cfg.extra.get("approximate", "tanh" if cfg.device == "cuda" else "none")


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    """A row per variant in the order they were built: timed, or unavailable with why."""
    phase, (M, K, N), dtype = case.params["phase"], case.params["shape"], case.params["dtype"]
    st, base = result.stats, result.stats.get("unfused")
    common = dict(device=cfg.device, dtype=str(dtype).removeprefix("torch."),
                  shape=f"{M}x{K}x{N}", phase=phase, approximate=_approximate(cfg),
                  timer="cpu-time, 1 thread" if _cpu_timer(cfg) else "wall")
    out = []
    for n, role_or_reason in result.info[0].items():
        if n not in st:
            out.append(row(SUITE, case.label, n, status="unavailable", reason=role_or_reason,
                           **common))
            continue
        sp = base.median_ms / st[n].median_ms if base else None
        out.append(row(SUITE, case.label, n, st[n], flops=_flops(phase, M, K, N),
                       role=role_or_reason, speedup_vs_unfused=sp, **common))
    return out
