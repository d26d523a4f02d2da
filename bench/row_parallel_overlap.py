"""Benchmark: the row-parallel GEMM overlapped with its all-reduce (tensor parallelism without
sequence parallelism), and the column-parallel backward (input-gradient all-reduce
overlapped with the weight-gradient GEMM); 2 gloo ranks, optionally over an emulated link.

Case ``fwd M,K,N``: per rank ``Y_partial = X (M, K) @ W^T (K, N)`` then all-reduce of the
``(M, N)`` result. Variants, interleaved in one run, each time the max over ranks:

- ``gemm`` / ``allreduce``: the parts alone; ``gemm_chunked<c>``: the GEMM in ``c`` row
  chunks with no communication (its ratio to ``gemm`` is the *chunking penalty*);
- ``sequential``: GEMM then all-reduce (the baseline);
- ``chunked<c>``: the overlap engine with ``c`` chunks;
- ``auto``: ``RowParallelLinear(overlap="auto")``'s forward (its first call measures and
  picks chunks or none; that call is warm-up), with the choice in ``extra``;
- ``ideal``: ``max(gemm, allreduce)`` from the medians (a bound, not timed).

- ``compute_alone_c<c>`` / ``comm_alone_c<c>``: each schedule's compute and its
  collectives, each alone and run the way that schedule runs them (``c0``: sequential): the
  engine with a communicator that moves nothing, and the engine with the GEMMs removed (same
  chunks, same asynchronous handles).

``hidden_frac`` = ``(compute + comm - variant) / min(compute, comm)`` with the variant's own
parts: the share of what could hide that the variant hid, from medians; its ceiling is 1
(``extra.hidden_ceiling``), and a row above it is a measurement error that the report flags
(``extra.hidden_frac_min``: the same from the fastest repetition of each, a view less
sensitive to a loaded machine). Case ``bwd M,K,N``:
``dX = dY (M, N) @ W (N, K)`` all-reduced while ``dW = dY^T @ X`` computes
(``chunked<c>`` chunks the dX GEMM too).

``cfg.net`` (e.g. ``"2gbit"``) runs the ranks in network namespaces joined by a
rate-limited link (:mod:`distllm.bench.netem`), and loopback too unless ``quick``; where the
link cannot be built the rows say so and run on loopback. Run:
``distllm bench --suite row_overlap --net 2gbit``, or
``python -m distllm.bench.row_parallel_overlap --net 2gbit``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Stats, interleaved, max_over_ranks_timer, row

from distllm.comm.compat import all_gather_into, reduce_scatter_into

SUITE = "row_overlap"
CHUNKS = (2, 4, 8)
_PRESETS = {True: [(256, 256, 512)], False: [(2048, 512, 2048), (512, 512, 1024)]}


def _shapes(cfg: BenchConfig, presets=_PRESETS) -> list[tuple[int, int, int]]:
    if cfg.shapes and "," in cfg.shapes:
        return [tuple(int(v) for v in s.split(",")) for s in cfg.shapes.split(";") if s.strip()]
    return presets[cfg.quick]


def cases(cfg: BenchConfig) -> list[str]:
    return [",".join(map(str, s)) for s in _shapes(cfg)]




def _variants(kind: str, shape, dims, comm, dtype) -> tuple[dict, object]:
    """name -> callable for one case; and the auto module/plan whose stats to report."""
    from distllm.comm.overlap import chunk_bounds, run_engine
    from distllm.nn.parallel_linear import ColumnParallelLinear, RowParallelLinear
    from distllm.parallel.tensor.tensor_parallel import OverlapPlan

    m, k, n = shape
    tp = dims.tp
    g = torch.Generator().manual_seed(dims.rank)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    w = rnd(n, k)
    v: dict = {}
    if kind in ("fwd", "rs"):  # (M, K) @ (K, N), then all-reduce / reduce-scatter of (M, N)
        x = rnd(1, m, k)
        mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
        ekind, a, n_out, then = ("all_reduce", x[0], n, None) if kind == "fwd" else (
            "reduce_scatter", x, n, None)
        comm_in = torch.empty(m * n, dtype=dtype)
        comm_out = torch.empty(m * n // tp, dtype=dtype)
        if kind == "fwd":
            v["allreduce"] = lambda: dist.all_reduce(comm_in, group=comm.group)
        else:  # the engine's reduce-scatter (gloo: pairwise exchange), and torch's for scale
            v["reducescatter_alone"] = lambda: comm.run("reduce_scatter", comm_out, comm_in)
            v["torch_reducescatter_alone"] = lambda: reduce_scatter_into(
                comm_out, comm_in, group=comm.group)
        auto = RowParallelLinear(k * tp, n, dims, bias=False, sequence_parallel=kind == "rs",
                                 overlap="auto", dtype=dtype)
        with torch.no_grad():
            auto.weight.copy_(w)
        v["auto"] = lambda: auto(x if kind == "rs" else x[0])
        stats_of = auto.overlap_stats
    elif kind == "ag":  # all-gather (M/tp, K) -> (M, K), then (M, K) @ (K, N)
        x = rnd(1, m // tp, k)
        mm = lambda a, o: torch.mm(a, w.t(), out=o)  # noqa: E731
        ekind, a, n_out, then = "all_gather", x, n, None
        comm_out = torch.empty(m * k, dtype=dtype)
        v["allgather_alone"] = lambda: all_gather_into(comm_out, x.view(-1), group=comm.group)
        auto = ColumnParallelLinear(k, n * tp, dims, bias=False, sequence_parallel=True,
                                    overlap="auto", dtype=dtype)
        with torch.no_grad():
            auto.weight.copy_(w)
        v["auto"] = lambda: auto(x)
        stats_of = auto.overlap_stats
    else:  # "bwd": dX = dY (M, N) @ W (N, K), all-reduced while dW = dY^T X computes
        gy, x = rnd(m, n), rnd(m, k)
        mm = lambda a, o: torch.mm(a, w, out=o)  # noqa: E731
        ekind, a, n_out, then = "all_reduce", gy, k, (lambda: gy.t() @ x)
        comm_in = torch.empty(m * k, dtype=dtype)
        v["allreduce"] = lambda: dist.all_reduce(comm_in, group=comm.group)
        plan = OverlapPlan(dims, "auto", 4, "bench-column-backward")
        v["auto"] = lambda: plan.run("backward", ekind, a, mm, n_out, then)
        stats_of = plan.stats
    full_rows = a.reshape(-1, a.shape[-1]) if ekind != "all_gather" else rnd(m, k)
    buf = torch.empty(full_rows.shape[0], n_out, dtype=dtype)

    def gemm(c: int) -> None:
        for s, e in chunk_bounds(full_rows.shape[0], c):
            mm(full_rows[s:e], buf[s:e])
        if then is not None:
            then()

    v["gemm"] = lambda: gemm(1)
    for c in CHUNKS:
        v[f"gemm_chunked{c}"] = lambda c=c: gemm(c)
    v["sequential"] = lambda: run_engine(ekind, a, mm, n_out, comm, 0, then)
    for c in ((1,) if kind == "bwd" else ()) + CHUNKS:
        v[f"chunked{c}"] = lambda c=c: run_engine(ekind, a, mm, n_out, comm, c, then)
    _schedule_parts(v, (ekind, a, mm, n_out, then), comm, (0, 1) if kind == "bwd" else (0,))
    return v, stats_of, (ekind, a, mm, n_out, then)


def _schedule_parts(v: dict, engine_args, comm, extra_chunks: tuple[int, ...]) -> None:
    """Each schedule's two parts, run the way the schedule runs them: ``compute_alone_c<c>``
    (the engine with chunks ``c`` and a communicator that moves nothing) and
    ``comm_alone_c<c>`` (the same engine, the same chunks and asynchronous handles, with the
    GEMMs and ``then`` removed); ``c0`` is the sequential schedule."""
    from distllm.comm.overlap import NullComm, run_engine

    ekind, a, mm, n_out, then = engine_args
    null = NullComm(comm)
    no_mm = lambda rows, out: None  # noqa: E731 - the collectives without their GEMM
    for c in extra_chunks + CHUNKS:
        v[f"compute_alone_c{c}"] = lambda c=c: run_engine(ekind, a, mm, n_out, null, c, then)
        v[f"comm_alone_c{c}"] = lambda c=c: run_engine(ekind, a, no_mm, n_out, comm, c, None)


def hidden_share(variant_ms: float, compute_ms: float, comm_ms: float) -> float | None:
    """The share of what could hide that the variant hid: ``(compute + comm - variant) /
    min(compute, comm)``, its parts timed alone the way the variant runs them. Its ceiling
    is 1 (the variant at ``max(compute, comm)``); above it, the measurement is wrong."""
    can_hide = min(compute_ms, comm_ms)
    return (compute_ms + comm_ms - variant_ms) / can_hide if can_hide > 0 else None


def _timeline(comm, engine_args, chunks: int) -> list[dict]:
    """One traced run of the engine: GEMM pieces on lane ``compute``, collectives (launch to
    completion, as gloo reports it) on lane ``comm``; ms from the start."""
    from distllm.comm.overlap import run_engine

    ekind, a, mm, n_out, then = engine_args
    spans: list[tuple[str, str, float, float]] = []

    def traced(name, fn):
        def call(*args):
            t0 = time.perf_counter()
            r = fn(*args)
            spans.append(("compute", name, t0, time.perf_counter()))
            return r
        return call

    comm.trace = []
    dist.barrier(group=comm.group)
    start = time.perf_counter()
    run_engine(ekind, a, traced("gemm", mm), n_out, comm, chunks,
               traced("wgrad", then) if then else None)
    time.sleep(0.01)  # let gloo's completion callbacks land
    spans += [("comm", op, t0, t1) for op, t0, t1 in comm.trace if t1 is not None]
    comm.trace = None
    return [{"lane": lane, "name": n, "start_ms": (t0 - start) * 1e3,
             "end_ms": (t1 - start) * 1e3} for lane, n, t0, t1 in spans]


def _rank(kinds: tuple[str, ...], shapes, reps: int, warmup: int, dtype_name: str):
    from distllm import ParallelDims
    from distllm.comm.overlap import CommContext

    dims = ParallelDims(tp=dist.get_world_size())
    comm = CommContext(dims.tp_group)
    dtype = getattr(torch, dtype_name)
    out = []
    for kind, shape in ((kd, sh) for kd in kinds for sh in shapes):
        v, st, engine_args = _variants(kind, shape, dims, comm, dtype)
        res = interleaved(v, warmup=warmup, reps=reps, timer=max_over_ranks_timer(dims.tp_group),
                          before_each=lambda: dist.barrier(group=dims.tp_group))
        info = st.as_dict() if hasattr(st, "as_dict") else {}
        best = min((n for n in res if n.startswith("chunked")), key=lambda n: res[n].median_ms)
        info["timelines"] = {"sequential": _timeline(comm, engine_args, 0),
                             best: _timeline(comm, engine_args, int(best[len("chunked"):]))}
        out.append((kind, shape, res, info))
    return out


def _case_rows(suite: str, kind: str, shape, res: dict[str, Stats], info: dict, net: str,
               dtype: str) -> list[dict]:
    m, k, n = shape
    case = f"{kind} {m},{k},{n} {net}"
    comm_name = next(x for x in res if x.startswith(("allreduce", "allgather", "reducescatter")))
    t_comm, t_gemm = res[comm_name].median_ms, res["gemm"].median_ms
    t_seq = res["sequential"].median_ms
    common = dict(dtype=dtype, shape=f"{m}x{k}x{n}", device="cpu", net=net)
    rows = []
    for name, st in res.items():
        extra: dict = {}
        if name == comm_name or name == "gemm" or name.endswith("_alone") or "_alone_c" in name:
            extra["role"] = "part"
        elif name.startswith("gemm_chunked"):
            extra.update(role="part", chunking_penalty=st.median_ms / t_gemm - 1)
        elif name == "sequential":
            extra["role"] = "unfused"
        else:
            extra.update(role="fused", vs_sequential=st.median_ms / t_seq - 1)
            if name == "auto":
                d = info.get("forward" if kind != "bwd" else "backward", {})
                extra.update(auto_chunks=d.get("chunks"), auto_reason=d.get("reason"))
        if name in info.get("timelines", {}):
            extra["timeline"] = info["timelines"][name]
        hid = None
        c = _chunks_of(name, extra)
        if extra["role"] == "fused" and f"comm_alone_c{c}" in res:
            comp, com = res[f"compute_alone_c{c}"], res[f"comm_alone_c{c}"]
            hid = hidden_share(st.median_ms, comp.median_ms, com.median_ms)
            # best-of-reps view, less sensitive to a loaded machine
            extra.update(hidden_frac_min=hidden_share(st.min_ms, comp.min_ms, com.min_ms),
                         compute_ms=comp.median_ms, comm_ms=com.median_ms,
                         hideable_ms=min(comp.median_ms, com.median_ms), hidden_ceiling=1.0)
        extra["ms_min"] = st.min_ms
        rows.append(row(suite, case, name, st, flops=2.0 * m * k * n, hidden_frac=hid,
                        speedup_vs_unfused=t_seq / st.median_ms, **common, **extra))
    ideal = max(t_gemm, t_comm)
    r = row(suite, case, "ideal", None, role="ideal", **common,
            hidden_frac=hidden_share(ideal, t_gemm, t_comm))
    r.update(ms=ideal, speedup_vs_unfused=t_seq / ideal)
    rows.append(r)
    return rows


def _chunks_of(name: str, extra: dict) -> int | None:
    """The chunk count a variant ran: ``chunked<c>``, or the one ``auto`` chose."""
    if name.startswith("chunked"):
        return int(name[len("chunked"):])
    return extra.get("auto_chunks") if name == "auto" else None


def run_kinds(cfg: BenchConfig, suite: str, kinds: tuple[str, ...], shapes) -> list[dict]:
    """Run ``kinds`` over ``shapes`` on 2 ranks for loopback and/or ``cfg.net``."""
    from distllm.bench.netem import link

    from distllm.testing import run_distributed

    reps = cfg.reps or (5 if cfg.quick else 10)
    nets = [cfg.net] if cfg.net else [None]
    if cfg.net and not cfg.quick:
        nets = [None, cfg.net]
    rows: list[dict] = []
    for net_rate in nets:
        with link(net_rate) as lk:
            label, reason = lk.label, lk.reason
            per = run_distributed(_rank, 2, kinds, shapes, reps, 2, cfg.dtype, timeout=1800,
                                  setup=lk.setup, env=lk.env)
            for kind, shape, res, info in per[0]:
                for r in _case_rows(suite, kind, shape, res, info, label, cfg.dtype):
                    r["reason"] = reason
                    rows.append(r)
    return rows


def _cuda_timer(fn) -> float:
    """ms between events on the current stream around ``fn`` (a side stream is not timed)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _cuda_case(m: int, k: int, n: int, dtype, reps: int, side) -> dict:
    from distllm.comm.overlap import chunk_bounds, pipeline_bounds

    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    src, dst = torch.empty_like(out), torch.empty_like(out)  # the all-reduce's bytes

    def gemm(bounds) -> None:
        for s, e in bounds:
            torch.mm(x[s:e], w.t(), out=out[s:e])  # (m, K) @ (K, N)

    def with_copy() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src)
        gemm([(0, m)])

    variants = {"gemm": lambda: gemm([(0, m)]),
                "gemm_chunked4": lambda: gemm(chunk_bounds(m, 4)),
                "gemm_pipeline4": lambda: gemm(pipeline_bounds(m, 4)),
                "gemm_with_copy": with_copy}
    return interleaved(variants, warmup=3, reps=reps, timer=_cuda_timer,
                       before_each=torch.cuda.synchronize)


def _cuda_rows(cfg: BenchConfig) -> list[dict]:
    """One GPU: the chunking penalty of the GEMM (equal chunks and the engines' tapered ones)
    and its slowdown while a copy kernel on another stream moves the all-reduce's bytes (the
    memory/SM interference a concurrent NCCL all-reduce adds). Times from CUDA events."""
    if not torch.cuda.is_available():
        return [row(SUITE, "-", "-", status="unavailable", reason="no CUDA device visible")]
    dtype = getattr(torch, cfg.dtype)
    shapes = [(8192, 8192, 8192)] if cfg.quick else [(8192, 8192, 8192), (4096, 4096, 16384)]
    if cfg.shapes and "," in cfg.shapes:
        shapes = _shapes(cfg)
    side = torch.cuda.Stream()
    rows = []
    for m, k, n in shapes:
        res = _cuda_case(m, k, n, dtype, cfg.reps or 20, side)
        base = res["gemm"].median_ms
        for name, st in res.items():
            pen = st.median_ms / base - 1
            if name == "gemm":
                extra = {"role": "unfused"}
            elif name == "gemm_with_copy":
                extra = {"role": "part", "slowdown": pen}
            else:  # the target: chunking penalty <= 5%
                extra = {"role": "part", "chunking_penalty": pen, "meets_target": pen <= 0.05}
            rows.append(row(SUITE, f"gpu {m},{k},{n}", name, st, flops=2.0 * m * k * n,
                            device="cuda", dtype=cfg.dtype, shape=f"{m}x{k}x{n}",
                            speedup_vs_unfused=base / st.median_ms, **extra))
    return rows


def run(cfg: BenchConfig) -> list[dict]:
    if cfg.device == "cuda":
        return _cuda_rows(cfg)
    if cfg.dtype not in ("float32", "float64", "bfloat16"):
        return [row(SUITE, "-", "-", status="unavailable",
                    reason=f"dtype={cfg.dtype}: the CPU suite runs float32/float64/bfloat16")]
    return run_kinds(cfg, SUITE, ("fwd", "bwd"), _shapes(cfg))


def summary(rows: list[dict]) -> str:
    """One line per case: hidden fraction of the best chunked variant and auto vs sequential."""
    lines = []
    cases_ = {r["case"] for r in rows}
    for c in sorted(cases_):
        cr = {r["variant"]: r for r in rows if r["case"] == c and r.get("ms")}
        ch = [r for v, r in cr.items() if v.startswith("chunked")]
        if not ch or "auto" not in cr:
            continue
        best = min(ch, key=lambda r: r["ms"])
        auto = cr["auto"]
        hmin = best["extra"].get("hidden_frac_min")
        hid = best["hidden_frac"]
        hid_s = "n/a" if hid is None else f"{hid:.0%}" + (
            " (above its ceiling: a wrong measurement)" if hid > 1 else "")
        lines.append(f"{c}: best {best['variant']} hides {hid_s} of what could (best-of-reps "
                     f"{hmin if hmin is None else format(hmin, '.0%')}) "
                     f"({best['ms']:.1f} ms vs sequential {cr['sequential']['ms']:.1f} ms, ideal "
                     f"{cr['ideal']['ms']:.1f} ms); auto={auto['extra'].get('auto_chunks')} "
                     f"chunks, {auto['extra']['vs_sequential']:+.1%} vs sequential")
    return "\n".join(lines)


def main(argv: list[str] | None = None, suite_run=run, stem: str = SUITE) -> int:
    import argparse
    from pathlib import Path

    from distllm.bench.harness import markdown_table, write_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = suite_run(BenchConfig(quick=a.quick, net=a.net, shapes=a.shapes, reps=a.reps))
    print(markdown_table(rows, ["case", "variant", "ms", "ms_p10", "ms_p90", "hidden_frac",
                                "speedup_vs_unfused", "status"]))
    print(summary(rows))
    if a.out:
        write_rows(rows, a.out, stem=stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
