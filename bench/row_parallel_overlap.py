"""Benchmark: the row-parallel GEMM overlapped with its all-reduce (tensor parallelism without
sequence parallelism), and the column-parallel backward (input-gradient all-reduce
overlapped with the weight-gradient GEMM); 2 gloo ranks, optionally over an emulated link.

Case ``fwd M,K,N``: per rank ``Y_partial = X (M, K) @ W^T (K, N)`` then all-reduce of the
``(M, N)`` result. Variants, interleaved in one run, each time the max over ranks:

- ``gemm`` / ``allreduce``: the parts alone (the all-reduce the engine runs,
  :func:`distllm.comm.collectives.all_reduce`: on 2 gloo ranks the exchange);
  ``gemm_chunked<c>``: the GEMM in the pieces that ``chunked<c>``'s engine computes, with no
  communication (:func:`engine_pieces`: sizes from
  :func:`~distllm.parallel.tensor.overlap.pipeline_bounds`, whose first and last pieces are
  half the others from 3 pieces on); its ratio to ``gemm`` is the *chunking penalty*;
- ``sequential``: GEMM then all-reduce (the baseline);
- ``chunked<c>``: the overlap engine with ``c`` chunks;
- ``auto``: ``RowParallelLinear(overlap="auto")``'s forward (its first call measures and
  picks chunks or none; that call is warm-up), with the choice in ``extra``;
- ``ideal``: ``max(gemm, allreduce)`` from the medians (a bound, not timed);
- ``sequential_again`` (role ``control``): the sequential schedule once more, declared
  last (the rounds alternate the order, so it runs last in one round and first in the
  next), where its neighbours are others than ``sequential``'s: an A/A control. Its ratio
  to ``sequential`` is how far one schedule reads from itself in this run
  (``extra.same_schedule_ratio`` on ``auto``'s row too), the resolution any verdict between
  two schedules of the case has (on 2 loopback ranks at (2048, 512, 2048) it read from 0.76x
  to 1.12x in four runs);
- ``gemm_beside_allreduce`` (all-reduce cases): the whole all-reduce started asynchronously,
  then the whole GEMM beside it, then the wait (no dependency between them): how much the
  collective's own CPU (gloo's copies, the kernel's TCP) slows the GEMM beside it and the
  other way round, on cores that run both. A reference, not a bound: its all-reduce is
  summed after the wait (on 2 gloo ranks, one exchange whose sum is taken when waited for),
  where a chunked schedule sums its earlier chunks while the later ones travel, so a
  schedule can hide more than it does.

- ``compute_alone_c<c>`` / ``comm_alone_c<c>``: each schedule's compute and its
  collectives, each alone and run the way that schedule runs them (``c0``: sequential): the
  engine with a communicator that moves nothing, and the engine with the GEMMs removed (same
  chunks, same asynchronous handles). ``compute_alone_auto`` / ``comm_alone_auto``: the same
  for the schedule ``auto`` chose on its first call (made while the case is set up), its
  chunk count and its piece sizes (``auto``'s geometric schedules are not ``chunked<c>``'s).

``hidden_frac`` = ``(compute + comm - variant) / min(compute, comm)`` with the variant's own
parts: the share of what could hide that the variant hid, from medians; its ceiling is 1
(``extra.hidden_ceiling``), and a row above it is a measurement error that the report flags
(``extra.hidden_frac_min``: the same from the fastest repetition of each, a view less
sensitive to a loaded machine; ``extra.hidden_band``: the p10..p90 of the share taken round
by round, :func:`hidden_band`, in which single rounds may pass 1). Where what can hide is no
larger than the p10..p90 width of either part, the share is noise and is not reported:
``hidden_frac`` is None, ``extra.hidden_unresolved`` says why and
``extra.hidden_frac_unresolved`` keeps the number (:func:`unresolved`).
``extra.beside_share`` is the share that ``gemm_beside_allreduce`` hides (of
``min(gemm, allreduce)``, the parts alone; its band ``extra.beside_share_band``), and
``extra.of_beside_share`` the variant's hidden share over it (above 1 where the schedule
hid more than the whole GEMM beside the whole all-reduce). Case ``bwd M,K,N``:
``dX = dY (M, N) @ W (N, K)`` all-reduced while ``dW = dY^T @ X`` computes (``chunked<c>``
chunks the dX GEMM too).

``cfg.net`` (e.g. ``"2gbit"``) runs the ranks in network namespaces joined by a
rate-limited link (:mod:`distllm.testing.netem`), and loopback too unless ``quick``; where
the link cannot be built, a quick run's rows say so and run on loopback, and a full run has
one ``unavailable`` row for the rate (loopback is measured already). With ``--device cuda`` the
cases are one GPU's: the GEMM's chunking penalty against its target (:data:`GPU_PENALTY_TARGET`;
the report's verdict states each penalty and whether the target was met) and its slowdown
beside a copy kernel.
Run: ``distllm bench --suite row_overlap --net 2gbit``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from distllm.bench.harness import BenchConfig, Case, Result, Setup, shapes
from distllm.bench.rows import judge_target, row

from distllm.comm.collectives import all_reduce
from distllm.comm.compat import all_gather_into, reduce_scatter_into
from distllm.diagnostics.timing import Stats, cuda_event_timer, paired_band

SUITE = "row_overlap"
CHUNKS = (2, 4, 8)
PRESETS = {True: [(256, 256, 512)], False: [(2048, 512, 2048), (512, 512, 1024)]}
GPU_PRESETS = {True: [(8192, 8192, 8192)], False: [(8192, 8192, 8192), (4096, 4096, 16384)]}
CPU_DTYPES = ("float32", "float64", "bfloat16")


def kind_cases(cfg: BenchConfig, suite: str, kinds: tuple[str, ...], presets: dict,
               skip: str = "") -> list[Case]:
    """One case per (kind, shape) on 2 gloo ranks, over loopback and ``cfg.net``."""
    if skip:
        return [Case("-", suite=suite, skip=skip)]
    return [Case(f"{kind} {','.join(map(str, shape))}", {"kind": kind, "shape": shape},
                 ranks=2, networks=True, suite=suite)
            for kind in kinds for shape in shapes(cfg, presets[cfg.quick])]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            return [Case("-", skip="no CUDA device visible")]
        return [Case(f"gpu {','.join(map(str, s))}", {"gpu": True, "shape": s})
                for s in shapes(cfg, GPU_PRESETS[cfg.quick])]
    skip = "" if cfg.dtype in CPU_DTYPES else \
        f"dtype={cfg.dtype}: the CPU suite runs {'/'.join(CPU_DTYPES)}"
    return kind_cases(cfg, SUITE, ("fwd", "bwd"), PRESETS, skip)


def layer_gemm(kind: str, w: torch.Tensor):
    """``mm(a, out)`` of case ``kind``: the layers' own engine callback (on CPU through
    :mod:`distllm.ops.cpu_gemm`, oneDNN or torch's, whichever measured faster for the shape),
    so that every variant and part of a case times the GEMM that ``auto``'s layer runs:
    ``a @ W^T`` for the forwards (``fwd``, ``rs``, ``ag``), the input gradient ``dY @ W`` for
    ``bwd``. (With torch's GEMM here and oneDNN's in the layer, ``auto`` would be credited
    with a faster GEMM as if it were overlap, and its hidden share could pass the machine's
    ceiling.)"""
    from distllm.parallel.tensor.layers import _mm, _mm_t

    return _mm(w) if kind == "bwd" else _mm_t(w)


def _variants(kind: str, shape, dims, comm, dtype) -> tuple[dict, object]:
    """name -> callable for one case; and the auto module/plan whose stats to report."""
    from distllm.nn.parallel_linear import ColumnParallelLinear, RowParallelLinear
    from distllm.parallel.tensor.layers import OverlapPlan, settle_overlap
    from distllm.parallel.tensor.overlap import run_engine

    m, k, n = shape
    tp = dims.tp
    g = torch.Generator().manual_seed(dims.rank)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    w = rnd(n, k)
    v: dict = {}
    if kind in ("fwd", "rs"):  # (M, K) @ (K, N), then all-reduce / reduce-scatter of (M, N)
        x = rnd(1, m, k)
        mm = layer_gemm(kind, w)
        ekind, a, n_out, then = ("all_reduce", x[0], n, None) if kind == "fwd" else (
            "reduce_scatter", x, n, None)
        comm_in = torch.empty(m * n, dtype=dtype)
        comm_out = torch.empty(m * n // tp, dtype=dtype)
        if kind == "fwd":
            v["allreduce"] = lambda: all_reduce(comm_in, group=comm.group)
        else:  # the engine's reduce-scatter (gloo: pairwise exchange), and torch's for scale
            v["reducescatter_alone"] = lambda: comm.run("reduce_scatter", comm_out, comm_in)
            v["torch_reducescatter_alone"] = lambda: reduce_scatter_into(
                comm_out, comm_in, group=comm.group)
        auto = RowParallelLinear(k * tp, n, dims, bias=False, sequence_parallel=kind == "rs",
                                 overlap="auto", dtype=dtype)
        with torch.no_grad():
            auto.weight.copy_(w)
        v["auto"] = lambda: auto(x if kind == "rs" else x[0])
        stats_of, tuned = auto.overlap_stats, auto
    elif kind == "ag":  # all-gather (M/tp, K) -> (M, K), then (M, K) @ (K, N)
        x = rnd(1, m // tp, k)
        mm = layer_gemm(kind, w)
        ekind, a, n_out, then = "all_gather", x, n, None
        comm_out = torch.empty(m * k, dtype=dtype)
        v["allgather_alone"] = lambda: all_gather_into(comm_out, x.view(-1), group=comm.group)
        auto = ColumnParallelLinear(k, n * tp, dims, bias=False, sequence_parallel=True,
                                    overlap="auto", dtype=dtype)
        with torch.no_grad():
            auto.weight.copy_(w)
        v["auto"] = lambda: auto(x)
        stats_of, tuned = auto.overlap_stats, auto
    else:  # "bwd": dX = dY (M, N) @ W (N, K), all-reduced while dW = dY^T X computes
        gy, x = rnd(m, n), rnd(m, k)
        mm = layer_gemm(kind, w)
        ekind, a, n_out, then = "all_reduce", gy, k, (lambda: gy.t() @ x)
        comm_in = torch.empty(m * k, dtype=dtype)
        v["allreduce"] = lambda: all_reduce(comm_in, group=comm.group)
        plan = OverlapPlan(dims, "auto", 4, "bench-column-backward")
        v["auto"] = lambda: plan.run("backward", ekind, a, mm, n_out, then)
        stats_of, tuned = plan.stats, plan
    full_rows = a.reshape(-1, a.shape[-1]) if ekind != "all_gather" else rnd(m, k)
    buf = torch.empty(full_rows.shape[0], n_out, dtype=dtype)

    def gemm(c: int) -> None:  # c: chunked<c>'s pieces; 0: the whole GEMM
        chunked_gemm(ekind, mm, full_rows, buf, c, tp, then)

    v["gemm"] = lambda: gemm(0)
    if ekind == "all_reduce":
        def beside() -> None:
            h = all_reduce(comm_in, group=comm.group, async_op=True)
            gemm(0)
            h.wait()

        v["gemm_beside_allreduce"] = beside
    for c in CHUNKS:
        v[f"gemm_chunked{c}"] = lambda c=c: gemm(c)
    v["sequential"] = lambda: run_engine(ekind, a, mm, n_out, comm, 0, then)
    for c in ((1,) if kind == "bwd" else ()) + CHUNKS:
        v[f"chunked{c}"] = lambda c=c: run_engine(ekind, a, mm, n_out, comm, c, then)
    # auto measures on its first call and, on CPU, tries its candidates in the next ones (on
    # every rank): its parts run the schedule it chose, the chunk count and the piece sizes
    # (a geometric schedule is not chunked<c>'s)
    settle_overlap(v["auto"], tuned, group=comm.group)
    counter = stats_of.backward if kind == "bwd" else stats_of.forward
    _schedule_parts(v, (ekind, a, mm, n_out, then), comm, (0, 1) if kind == "bwd" else (0,),
                    auto=(counter.chunks, counter.growth))
    v["sequential_again"] = v["sequential"]  # the A/A control: declared last
    return v, stats_of, (ekind, a, mm, n_out, then)


def engine_pieces(ekind: str, rows: int, chunks: int, tp: int) -> list[int]:
    """The rows of each GEMM that the overlap engine of collective ``ekind`` runs with
    ``chunks`` (>= 1) on a product of ``rows`` rows over ``tp`` ranks, in order: the pieces
    of :func:`~distllm.parallel.tensor.overlap.pipeline_bounds` (first and last halved from 3
    pieces on), of the rows for ``all_reduce``; of each rank's ``rows / tp`` sequence rows
    for ``reduce_scatter`` (a piece's GEMM computes them for every destination) and for
    ``all_gather`` (the local shard whole first, then each piece of every other rank's)."""
    from distllm.parallel.tensor.overlap import pipeline_bounds

    if ekind == "all_reduce":
        return [e - s for s, e in pipeline_bounds(rows, chunks)]
    bounds = pipeline_bounds(rows // tp, chunks)
    if ekind == "reduce_scatter":
        return [tp * (e - s) for s, e in bounds]
    return [rows // tp] + [e - s for s, e in bounds for _ in range(tp - 1)]


def chunked_gemm(ekind: str, mm, rows: torch.Tensor, out: torch.Tensor, chunks: int, tp: int,
                 then=None) -> None:
    """``mm`` of ``rows`` into ``out`` in the pieces that the engine of ``ekind`` computes with
    ``chunks`` (:func:`engine_pieces`; 0: one GEMM of all rows), with no communication, then
    ``then()``: the ``gemm`` and ``gemm_chunked<c>`` variants."""
    s = 0
    for n in engine_pieces(ekind, rows.shape[0], chunks, tp) if chunks else [rows.shape[0]]:
        mm(rows[s:s + n], out[s:s + n])  # (n, K) @ (K, N)
        s += n
    if then is not None:
        then()


def _schedule_parts(v: dict, engine_args, comm, extra_chunks: tuple[int, ...],
                    auto: tuple[int, float | None] | None = None) -> None:
    """Each schedule's two parts, run the way the schedule runs them: ``compute_alone_c<c>``
    (the engine with chunks ``c`` and a communicator that moves nothing) and
    ``comm_alone_c<c>`` (the same engine, the same chunks and asynchronous handles, with the
    GEMMs and ``then`` removed); ``c0`` is the sequential schedule. ``auto``: the ``(chunks,
    growth)`` that ``overlap="auto"`` chose, whose parts are ``compute_alone_auto`` and
    ``comm_alone_auto``."""
    from distllm.parallel.tensor.overlap import NullComm, run_engine

    ekind, a, mm, n_out, then = engine_args
    null = NullComm(comm)
    no_mm = lambda rows, out: None  # noqa: E731 - the collectives without their GEMM
    for c in extra_chunks + CHUNKS:
        v[f"compute_alone_c{c}"] = lambda c=c: run_engine(ekind, a, mm, n_out, null, c, then)
        v[f"comm_alone_c{c}"] = lambda c=c: run_engine(ekind, a, no_mm, n_out, comm, c, None)
    if auto is not None:
        c, g = auto
        v["compute_alone_auto"] = lambda: run_engine(ekind, a, mm, n_out, null, c, then, g)
        v["comm_alone_auto"] = lambda: run_engine(ekind, a, no_mm, n_out, comm, c, None, g)


def hidden_share(variant_ms: float, compute_ms: float, comm_ms: float) -> float | None:
    """The share of what could hide that the variant hid: ``(compute + comm - variant) /
    min(compute, comm)``, its parts timed alone the way the variant runs them. Its ceiling
    is 1 (the variant at ``max(compute, comm)``); above it, the measurement is wrong."""
    can_hide = min(compute_ms, comm_ms)
    return (compute_ms + comm_ms - variant_ms) / can_hide if can_hide > 0 else None


def hidden_band(variant: Stats, compute: Stats, comm: Stats) -> tuple[float, float] | None:
    """The p10..p90 of :func:`hidden_share` round by round (repetition ``i`` of the variant
    and of its two parts ran in the same round; see
    :func:`~distllm.diagnostics.timing.paired_band`), widened to hold the share of the
    medians that is printed with it (as the report's speed-up band holds its ratio), or None
    with too few rounds."""
    band = paired_band(hidden_share, variant.samples_ms, compute.samples_ms, comm.samples_ms)
    mid = hidden_share(variant.median_ms, compute.median_ms, comm.median_ms)
    if band is None or mid is None:
        return band
    return min(band[0], mid), max(band[1], mid)


def unresolved(can_hide: float, *parts: Stats) -> str:
    """Why a hidden share whose parts are ``parts`` cannot be told from noise, or "": what can
    hide (``can_hide`` ms; the row suite's ``min(compute, comm)``, the DDP suite's
    ``min(backward, reduction)``) is no larger than the p10..p90 width of any part timed
    alone. Then a share above 100% or far below 0 is the spread of the parts, as with the
    3-6 ms collectives of a loopback case beside a GEMM that spreads by 8 ms."""
    width = max(p.p90_ms - p.p10_ms for p in parts)
    if can_hide > width:
        return ""
    return (f"what can hide ({can_hide:.3g} ms) is within the spread of its parts timed alone "
            f"(p10..p90 {width:.3g} ms wide)")


def _timeline(comm, engine_args, chunks: int) -> list[dict]:
    """One traced run of the engine: GEMM pieces on lane ``compute``, collectives (launch to
    completion, as gloo reports it; for the 2-rank exchange, to the return of its wait) on
    lane ``comm``; ms from the start."""
    from distllm.parallel.tensor.overlap import run_engine

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


def setup(cfg: BenchConfig, case: Case) -> Setup:
    """The variants of one case, built on every rank (see the module docstring)."""
    if case.params.get("gpu"):
        return _gpu_setup(cfg, case)
    from distllm import ParallelDims
    from distllm.parallel.tensor.overlap import CommContext

    dims = ParallelDims(tp=dist.get_world_size())
    comm = CommContext(dims.tp_group)
    v, st, engine_args = _variants(case.params["kind"], case.params["shape"], dims, comm,
                                   getattr(torch, cfg.dtype))

    def finish(stats: dict[str, Stats]) -> dict:
        """The auto layer's record, and one traced step of the sequential schedule and of
        the fastest chunked one."""
        info = st.as_dict() if hasattr(st, "as_dict") else {}
        best = min((n for n in stats if n.startswith("chunked")),
                   key=lambda n: stats[n].median_ms)
        info["timelines"] = {"sequential": _timeline(comm, engine_args, 0),
                             best: _timeline(comm, engine_args, int(best[len("chunked"):]))}
        return info

    return Setup(v, warmup=2, reps=cfg.reps or (5 if cfg.quick else 10), finish=finish)


def rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    if case.params.get("gpu"):
        return _gpu_rows(cfg, case, result)
    out = case_rows(case.suite or SUITE, case.params["kind"], case.params["shape"],
                    result.stats, result.info[0], result.net, cfg.dtype)
    for r in out:
        r["reason"] = result.net_reason
    return out


def case_rows(suite: str, kind: str, shape, res: dict[str, Stats], info: dict, net: str,
               dtype: str) -> list[dict]:
    m, k, n = shape
    case = f"{kind} {m},{k},{n} {net}"
    comm_name = next(x for x in res if x.startswith(("allreduce", "allgather", "reducescatter")))
    t_comm, t_gemm = res[comm_name].median_ms, res["gemm"].median_ms
    t_seq = res["sequential"].median_ms
    again = res.get("sequential_again")
    aa = t_seq / again.median_ms if again is not None else None  # speed, as speedup_vs_unfused
    common = dict(dtype=dtype, shape=f"{m}x{k}x{n}", device="cpu", net=net)
    beside = res.get("gemm_beside_allreduce")
    beside_sh = hidden_share(beside.median_ms, t_gemm, t_comm) if beside is not None else None
    beside_band = None if beside is None else hidden_band(beside, res["gemm"], res[comm_name])
    # a hidden share too: the same ceiling (100%), and unreported where its parts' spread
    # swallows what can hide
    beside_extra: dict = {}
    if beside is not None:
        why = unresolved(min(t_gemm, t_comm), res["gemm"], res[comm_name])
        if why:
            beside_extra.update(beside_unresolved=why, beside_share_unresolved=beside_sh)
            beside_sh = None
        else:
            beside_extra["beside_above_ceiling"] = beside_sh > 1.0
    rows = []
    for name, st in res.items():
        extra: dict = {}
        if name == "gemm_beside_allreduce":
            extra.update(role="part", beside_share=beside_sh, beside_share_band=beside_band,
                         **beside_extra)
        elif name == comm_name or name == "gemm" or name.endswith("_alone") or "_alone_" in name:
            extra["role"] = "part"
        elif name.startswith("gemm_chunked"):
            extra.update(role="part", chunking_penalty=st.median_ms / t_gemm - 1)
        elif name == "sequential":
            extra["role"] = "unfused"
        elif name == "sequential_again":
            extra.update(role="control", vs_sequential=st.median_ms / t_seq - 1)
        else:
            extra.update(role="fused", vs_sequential=st.median_ms / t_seq - 1)
            if name == "auto":
                d = info.get("forward" if kind != "bwd" else "backward", {})
                extra.update(auto_chunks=d.get("chunks"), auto_reason=d.get("reason"),
                             same_schedule_ratio=aa)
        if name in info.get("timelines", {}):
            extra["timeline"] = info["timelines"][name]
        hid = None
        c = _chunks_of(name, extra)
        tag = "auto" if name == "auto" and "comm_alone_auto" in res else f"c{c}"
        if extra["role"] == "fused" and f"comm_alone_{tag}" in res:
            comp, com = res[f"compute_alone_{tag}"], res[f"comm_alone_{tag}"]
            hid = hidden_share(st.median_ms, comp.median_ms, com.median_ms)
            # best-of-reps view, less sensitive to a loaded machine
            extra.update(hidden_frac_min=hidden_share(st.min_ms, comp.min_ms, com.min_ms),
                         hidden_band=hidden_band(st, comp, com),
                         compute_ms=comp.median_ms, comm_ms=com.median_ms,
                         hideable_ms=min(comp.median_ms, com.median_ms), hidden_ceiling=1.0)
            why = unresolved(min(comp.median_ms, com.median_ms), comp, com)
            if why:  # a share this run cannot tell apart from noise: kept, not reported
                extra.update(hidden_unresolved=why, hidden_frac_unresolved=hid)
                hid = None
            if beside_sh is not None and hid is not None:
                extra.update(beside_share=beside_sh,
                             of_beside_share=hid / beside_sh if beside_sh > 0 else None)
        extra["ms_min"] = st.min_ms
        # a backward's variants run the dX and the dW GEMMs; a collective alone runs none
        flops = None if collective_only(name) else (4.0 if kind == "bwd" else 2.0) * m * k * n
        rows.append(row(suite, case, name, st, flops=flops, hidden_frac=hid,
                        speedup_vs_unfused=t_seq / st.median_ms, **common, **extra))
    ideal = max(t_gemm, t_comm)
    r = row(suite, case, "ideal", None, role="ideal", **common,
            hidden_frac=hidden_share(ideal, t_gemm, t_comm))
    r.update(ms=ideal, speedup_vs_unfused=t_seq / ideal)
    rows.append(r)
    return rows


def collective_only(name: str) -> bool:
    """Whether variant ``name`` of a CPU case runs collectives and no GEMM (no FLOP/s to
    report): the case's collective alone (``allreduce``, ``allgather_alone``,
    ``reducescatter_alone``), torch's for scale (``torch_reducescatter_alone``), and each
    schedule's ``comm_alone_c<c>`` / ``comm_alone_auto``."""
    return name == "allreduce" or name.startswith("comm_alone") or name.endswith("_alone")


def _chunks_of(name: str, extra: dict) -> int | None:
    """The chunk count a variant ran: ``chunked<c>``, or the one ``auto`` chose."""
    if name.startswith("chunked"):
        return int(name[len("chunked"):])
    return extra.get("auto_chunks") if name == "auto" else None


def _gpu_setup(cfg: BenchConfig, case: Case) -> Setup:
    """One GPU: the GEMM whole, in 4 equal row chunks, in the engines' 4 tapered pieces, and
    beside a copy kernel on another stream that moves the all-reduce's bytes (the
    memory/SM interference a concurrent NCCL all-reduce adds). Times from CUDA events."""
    from distllm.parallel.tensor.overlap import chunk_bounds, pipeline_bounds

    m, k, n = case.params["shape"]
    dtype = getattr(torch, cfg.dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    src, dst = torch.empty_like(out), torch.empty_like(out)  # the all-reduce's bytes
    side = torch.cuda.Stream()

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
    return Setup(variants, warmup=3, reps=cfg.reps or 20, timer=cuda_event_timer,
                 before_each=torch.cuda.synchronize)


GPU_PENALTY_TARGET = 0.05  # the most a chunked GEMM may take over the whole one on a GPU


def _gpu_rows(cfg: BenchConfig, case: Case, result: Result) -> list[dict]:
    """The GPU case's rows: each chunked GEMM's penalty over the whole ``gemm`` against
    :data:`GPU_PENALTY_TARGET` (``extra.chunking_penalty``, ``target``, ``meets_target``: the
    median's; ``target_status``: met only where the penalty's p10..p90 round by round is
    within the target, :func:`~distllm.bench.rows.judge_target`; the report's verdict states
    them), and the GEMM's slowdown beside a copy kernel."""
    m, k, n = case.params["shape"]
    res = result.stats
    base = res["gemm"].median_ms
    out = []
    for name, st in res.items():
        pen = st.median_ms / base - 1
        if name == "gemm":
            extra = {"role": "unfused"}
        elif name == "gemm_with_copy":
            extra = {"role": "part", "slowdown": pen}
        else:
            band = paired_band(lambda c, g: c / g - 1, st.samples_ms, res["gemm"].samples_ms)
            extra = {"role": "part", "chunking_penalty": pen,
                     "target": f"<= {GPU_PENALTY_TARGET}",
                     "meets_target": pen <= GPU_PENALTY_TARGET,
                     **judge_target((pen, band, GPU_PENALTY_TARGET))}
        out.append(row(SUITE, case.label, name, st, flops=2.0 * m * k * n, device="cuda",
                       dtype=cfg.dtype, shape=f"{m}x{k}x{n}",
                       speedup_vs_unfused=base / st.median_ms, **extra))
    return out
