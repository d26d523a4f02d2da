"""The GPU benchmark of ``bench/gpu_check.sh``: four measurements on one CUDA GPU, each
timed with CUDA events over interleaved repetitions (median, p10..p90), in one process.

1. ``linear_gelu``: y = gelu_tanh(x W^T + b) in bfloat16 at (M, K, N) = (8192, 4096, 16384)
   and (4096, 4096, 4096), forward without autograd: ``fused-cuda`` (cuBLASLt epilogue),
   ``fused-triton``, ``unfused`` (F.linear then F.gelu), ``peer-addmm-activation``
   (``torch._addmm_activation(b, x, W^T, use_gelu=True)``, PyTorch's own fused epilogue) and
   ``gemm-nobias`` (F.linear without bias: the bare cuBLAS GEMM, the floor; role ``part``
   in ``extra.role``, no contender). TFLOP/s count 2*M*K*N per call; ``speedup_vs_unfused``
   is the ratio of medians in this run.
2. ``parallel_mlp``: ``ParallelMLP`` at tp1 in bfloat16, (tokens, hidden, ffn) =
   (8192, 4096, 16384), forward + backward: ``fused-cuda`` (cuBLASLt GELU_AUX_BIAS forward,
   DGELU_BGRAD backward across the two GEMMs), ``fused-triton``, and ``unfused``
   (``backend="reference"``: the GEMMs, then GeLU and its derivative as separate passes).
   TFLOP/s count the six GEMMs, 12*M*H*F per call.
3. ``chunk_penalty``: one (8192, 8192) @ (8192, 8192) GEMM against the same product as 4
   row-chunk GEMMs (what an overlap engine with 4 chunks runs instead of one GEMM); both
   role ``part`` (a penalty, not a speed-up).
4. ``two_streams``: a GEMM on one stream beside an elementwise kernel (a stand-in for a
   communication kernel) on a second stream, issued in either order: the fraction of the
   shorter one hidden (1 = fully concurrent, 0 = serialised), unclipped: a fraction above 1
   or below 0 is a measurement error, marked ``extra.above_ceiling`` / ``extra.below_floor``
   as in the CPU suites. Measured in two child processes, with and without
   ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (which must be set before CUDA starts).

Run: ``python -m distllm.bench.gpu_bench --out results.json`` (``--quick``: fewer
repetitions). Rows are :func:`distllm.bench.rows.row` dicts; a variant that fails is a
row with ``status="error"`` and its reason, never a crash of the whole run. ``--out`` is
rewritten (atomically) after each measurement, with ``"complete": false`` and the
measurements still to run until the last one is done, so a run stopped by a timeout keeps
what it measured; SIGINT (``timeout -s INT``) writes what ran and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from distllm.bench.report import above_ceiling, below_floor
from distllm.bench.rows import machine_info, markdown_table, row

from distllm.diagnostics.timing import Timer, cuda_event_timer, interleaved

SUITE = "gpu"
LINEAR_SHAPES = [(8192, 4096, 16384), (4096, 4096, 4096)]
MLP_SHAPE = (8192, 4096, 16384)
CHUNK_N, CHUNKS = 8192, 4
CUDA_VARIANT = "fused-cuda"  # a row of it only when cuBLASLt ran (no fallback)


def _timed_rows(
    case: str,
    variants: dict,
    timer: Timer,
    reps: int,
    warmup: int,
    flops: float,
    base: str,
    roles: dict[str, str] | None = None,
    **common,
) -> list[dict]:
    """Rows of ``variants`` timed interleaved; ``roles``: variant -> ``extra.role`` (the
    report's role, for variants whose name does not say it)."""
    from distllm.ops import linear_gelu_backends

    roles = roles or {}
    failed: dict[str, str] = {}  # a variant that raises is a row with its error, not a crash
    linear_gelu_backends._fallback_warned.clear()
    st = interleaved(variants, warmup=warmup, reps=reps, timer=timer, errors=failed)
    if CUDA_VARIANT in st and linear_gelu_backends._fallback_warned:
        # cuBLASLt offered no algorithm and another backend ran: not cuBLASLt's figure
        del st[CUDA_VARIANT]
        failed[CUDA_VARIANT] = ("cuBLASLt had no algorithm for these inputs ("
                                + ", ".join(sorted(linear_gelu_backends._fallback_warned))
                                + "): the op fell back to another backend")
    role = {n: {"role": roles[n]} if n in roles else {} for n in variants}
    out = [row(SUITE, case, n, status="error", reason=why, **role[n], **common)
           for n, why in failed.items()]
    for name, s in st.items():
        sp = st[base].median_ms / s.median_ms if base in st else None
        out.append(row(SUITE, case, name, s, flops=flops, speedup_vs_unfused=sp,
                       spread=s.spread, **role[name], **common))
    return out


def linear_gelu_variants(x, w, b) -> dict[str, Callable[[], object]]:
    """The variants of measurement 1 on ``x`` (M, K), ``w`` (N, K), ``b`` (N,)."""
    from distllm.ops import linear_gelu

    wt = w.t()
    return {
        "unfused": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "fused-cuda": lambda: linear_gelu(x, w, b, approximate="tanh", backend="cuda"),
        "fused-triton": lambda: linear_gelu(x, w, b, approximate="tanh", backend="triton"),
        "peer-addmm-activation": lambda: torch._addmm_activation(b, x, wt, use_gelu=True),
        "gemm-nobias": lambda: F.linear(x, w),
    }


def bench_linear_gelu(
    shapes, dtype: torch.dtype, device: str, timer: Timer, reps: int, warmup: int = 3
) -> list[dict]:
    rows = []
    for M, K, N in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(M, K, device=device, dtype=dtype, generator=g)
        w = torch.randn(N, K, device=device, dtype=dtype, generator=g) * K**-0.5
        b = torch.randn(N, device=device, dtype=dtype, generator=g) * 0.1
        case = f"linear_gelu fwd {M}x{K}x{N} {str(dtype).removeprefix('torch.')}"
        with torch.no_grad():
            rows += _timed_rows(
                case,
                linear_gelu_variants(x, w, b),
                timer,
                reps,
                warmup,
                2.0 * M * K * N,
                "unfused",
                roles={"gemm-nobias": "part"},  # the bare GEMM: the floor, no contender
                shape=f"{M}x{K}x{N}",
                dtype=str(dtype).removeprefix("torch."),
                device=device,
            )
        del x, w, b
    return rows


def bench_parallel_mlp(
    shape, dtype: torch.dtype, device: str, timer: Timer, reps: int, warmup: int = 3, dims=None
) -> list[dict]:
    """ParallelMLP at tp1, forward + backward, per backend (see the module docstring);
    ``dims``: the tp=1 mesh (default: a 1-rank gloo world, started here if none runs)."""
    from distllm import ParallelDims
    from distllm.nn import ParallelMLP

    m, h, f = shape
    if dims is None:
        dims = ParallelDims(tp=1, backend="gloo")  # one rank: nothing communicates
    torch.manual_seed(0)
    x = torch.randn(1, m, h, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(1, m, h, device=device, dtype=dtype)
    mlps = {
        name: ParallelMLP(h, f, dims, activation="gelu_tanh", dtype=dtype, device=device,
                          backend=be)
        for name, be in (("unfused", "reference"), ("fused-cuda", "cuda"),
                         ("fused-triton", "triton"))
    }

    def step(mod):
        params = list(mod.parameters())

        def call():
            for p in params:
                p.grad = None
            x.grad = None
            mod(x).backward(g)

        return call

    rows = _timed_rows(
        f"parallel_mlp tp1 fwd+bwd {m}x{h}x{f} {str(dtype).removeprefix('torch.')}",
        {n: step(mod) for n, mod in mlps.items()},
        timer,
        reps,
        warmup,
        12.0 * m * h * f,
        "unfused",
        shape=f"{m}x{h}x{f}",
        dtype=str(dtype).removeprefix("torch."),
        device=device,
    )
    return rows


def bench_chunk_penalty(
    n: int, chunks: int, dtype: torch.dtype, device: str, timer: Timer, reps: int, warmup: int = 3
) -> list[dict]:
    """One (n, n) @ (n, n) GEMM against ``chunks`` row-chunk GEMMs of the same product."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    bm = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    c = torch.empty(n, n, device=device, dtype=dtype)
    variants = chunk_penalty_variants(a, bm, c, chunks)
    # "speedup" of the chunked form below 1 is the penalty: both are parts, no contenders
    return _timed_rows(
        f"chunk penalty {n}^3 {str(dtype).removeprefix('torch.')}",
        variants,
        timer,
        reps,
        warmup,
        2.0 * n**3,
        "one-gemm",
        roles=dict.fromkeys(variants, "part"),
        device=device,
        shape=f"{n}x{n}x{n}",
        dtype=str(dtype).removeprefix("torch."),
    )


def chunk_penalty_variants(a, bm, c, chunks: int) -> dict[str, Callable[[], object]]:
    """The variants of measurement 3: ``a @ bm`` written into ``c`` (all (n, n)), as one
    GEMM and as ``chunks`` row-chunk GEMMs."""
    from distllm.parallel.tensor.overlap import chunk_bounds

    def chunked():
        for s, e in chunk_bounds(a.shape[0], chunks):
            torch.mm(a[s:e], bm, out=c[s:e])  # (n/chunks, n) @ (n, n)

    return {"one-gemm": lambda: torch.mm(a, bm, out=c), f"{chunks}-chunk-gemms": chunked}


def overlap_fraction(t_a: float, t_b: float, t_both: float) -> float | None:
    """Fraction of the shorter of two kernels hidden when both run at once:
    (t_a + t_b - t_both) / min(t_a, t_b), not clipped: above 1 (both together faster than
    the longer alone) or below 0 (slower than both in a row) the measurement is wrong, which
    the row marks. None when the shorter one took no time."""
    shorter = min(t_a, t_b)
    if shorter <= 0:
        return None
    return (t_a + t_b - t_both) / shorter


def _hidden_row(case: str, variant: str, frac: float | None) -> dict:
    """A two-streams hidden fraction as a row: ceiling 1, floor 0, and whether it passes
    either (``extra.above_ceiling`` / ``extra.below_floor``)."""
    r = row(SUITE, case, variant, status="ok", hidden_frac=frac, hidden_ceiling=1.0,
            hidden_floor=0.0, role="part")
    if frac is not None:
        r["extra"].update(above_ceiling=above_ceiling(r), below_floor=below_floor(r))
    return r


def two_streams(n: int = 8192, elems: int = 1 << 29, reps: int = 10) -> dict[str, float]:
    """GEMM (n^3, bf16) on stream 1 beside an elementwise kernel over ``elems`` bf16 values on
    stream 2: medians of each alone and of both, in both issue orders (ms), and the hidden
    fractions. Runs in the calling process, whose CUDA_DEVICE_MAX_CONNECTIONS is fixed."""
    import statistics

    dev = torch.device("cuda")
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bm = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.randn(elems, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    s_gemm, s_elem = torch.cuda.Stream(), torch.cuda.Stream()

    def gemm():
        with torch.cuda.stream(s_gemm):
            torch.mm(a, bm, out=c)

    def elem():
        with torch.cuda.stream(s_elem):
            torch.add(src, 1.0, out=dst)

    def timed(*fns) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in (s_gemm, s_elem):
            s.wait_event(start)
        for fn in fns:
            fn()
        for s in (s_gemm, s_elem):
            torch.cuda.current_stream().wait_stream(s)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    cases = {
        "gemm": (gemm,),
        "elementwise": (elem,),
        "gemm_then_elementwise": (gemm, elem),
        "elementwise_then_gemm": (elem, gemm),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(reps + 2):  # two warm-up rounds
        for k in list(cases) if i % 2 else list(cases)[::-1]:
            t = timed(*cases[k])
            if i >= 2:
                samples[k].append(t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for order in ("gemm_then_elementwise", "elementwise_then_gemm"):
        med[f"hidden_{order}"] = overlap_fraction(med["gemm"], med["elementwise"], med[order])
    return med


def two_streams_rows(reps: int, python: str = sys.executable) -> list[dict]:
    """``two_streams`` in two child processes: CUDA_DEVICE_MAX_CONNECTIONS unset and 1."""
    rows = []
    for value in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
        if value is not None:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
        label = f"CUDA_DEVICE_MAX_CONNECTIONS={value or 'unset'}"
        cmd = [python, "-m", "distllm.bench.gpu_bench", "--two-streams-child", str(reps)]
        try:
            p = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
            why = "" if res else (p.stderr.strip().splitlines() or ["no output"])[-1]
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            res, why = None, f"{type(exc).__name__}: {exc}"
        if res is None:
            rows.append(row(SUITE, f"two streams, {label}", "-", status="error", reason=why))
            continue
        for k, v in res.items():
            case = f"two streams, {label}"
            rows.append(_hidden_row(case, k, v) if k.startswith("hidden_") else
                        row(SUITE, case, k, status="ok", ms=v))
    return rows


def run_all(
    quick: bool = False,
    timer: Timer = cuda_event_timer,
    device: str = "cuda",
    linear_shapes=None,
    mlp_shape=None,
    chunk_n: int = CHUNK_N,
    streams: bool = True,
    progress: Callable[[list[dict], list[str]], object] | None = None,
) -> list[dict]:
    """Every measurement, in order; ``progress(rows so far, measurements left)`` runs before
    the first and after each one (``main`` writes ``--out`` there). Those that compile no
    Triton kernel come first, so that a run cut short by its time limit loses the ones that
    tune (each Triton configuration is a compile)."""
    reps = 10 if quick else 30
    dt = torch.bfloat16
    steps: list[tuple[str, Callable[[], list[dict]]]] = [
        ("chunk_penalty", lambda: bench_chunk_penalty(chunk_n, CHUNKS, dt, device, timer,
                                                      reps))]
    steps += [("two_streams", lambda: two_streams_rows(reps))] if streams else []
    steps += [(f"linear_gelu {s}", lambda s=s: bench_linear_gelu([s], dt, device, timer, reps))
              for s in (linear_shapes or LINEAR_SHAPES)]
    steps += [("parallel_mlp", lambda: bench_parallel_mlp(mlp_shape or MLP_SHAPE, dt, device,
                                                          timer, reps))]
    rows: list[dict] = []
    if progress is not None:
        progress(rows, [name for name, _ in steps])
    for i, (_, step) in enumerate(steps):
        rows += step()
        if progress is not None:
            progress(rows, [name for name, _ in steps[i + 1:]])
    return rows


def write_results(path: Path, rows: list[dict], machine: dict, left: list[str],
                  interrupted: str = "") -> None:
    """``path`` as JSON (rows, machine, whether complete and what is left), written to a
    temporary file beside it and renamed over it: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "complete": not left and not interrupted, "left": left,
            "rows": rows}
    if interrupted:
        data["interrupted"] = interrupted
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m distllm.bench.gpu_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, help="write the rows and the machine here (JSON)")
    ap.add_argument("--quick", action="store_true", help="10 repetitions instead of 30")
    ap.add_argument("--two-streams-child", type=int, metavar="REPS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    if args.two_streams_child:
        print(json.dumps(two_streams(reps=args.two_streams_child)))
        return 0
    machine, done = machine_info(), {"rows": [], "left": ["every measurement"]}

    def progress(rows: list[dict], left: list[str]) -> None:
        done.update(rows=list(rows), left=left)
        if args.out:
            write_results(args.out, rows, machine, left)

    try:
        rows = run_all(quick=args.quick, progress=progress)
    except KeyboardInterrupt:  # timeout -s INT: keep what was measured, say what was not
        if args.out:
            write_results(args.out, done["rows"], machine, done["left"], "SIGINT")
        print(f"gpu_bench: interrupted; not measured: {', '.join(done['left'])}",
              file=sys.stderr)
        return 130
    print(
        markdown_table(
            rows,
            [
                "case",
                "variant",
                "ms",
                "ms_p10",
                "ms_p90",
                "tflops",
                "speedup_vs_unfused",
                "hidden_frac",
                "status",
                "reason",
            ],
        )
    )
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
