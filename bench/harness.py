"""The shared benchmark harness.

Every benchmark module (``bench/<op>.py``) exposes ``run(cfg: BenchConfig) -> list[dict]``
and returns rows built with :func:`row`. Timing goes through :func:`interleaved`:
warm-up, then repetitions of the variants in turn (A B C A B C ...), so that drift of the
machine hits every variant alike; the result per variant is the median with the 10th/90th
percentiles as spread. Ratios between variants are meaningful within one run; absolute
times are only meaningful on the machine recorded in the row.

Overlap benchmarks may attach one representative step as ``timeline=[{"lane": "compute" |
"comm", "name": str, "start_ms": float, "end_ms": float}, ...]`` (a keyword of :func:`row`,
stored in ``row["extra"]``); ``distllm bench`` draws it (contract in ``bench/plots.py``). A
variant's role in the report (fused / unfused / peer / ideal / part) is guessed from its name
or set with ``role=...`` (see ``bench/report.py``).
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BenchConfig",
    "max_over_ranks_timer",
    "Stats",
    "interleaved",
    "row",
    "machine_info",
    "write_rows",
    "markdown_table",
    "ROW_FIELDS",
]


@dataclass
class BenchConfig:
    """What a benchmark module is asked to run."""

    quick: bool = False  # a tiny shape set for CI and a first look (whole suite < 5 min, 2 cores)
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"  # "float32", "bfloat16", "float16"
    shapes: str | None = None  # a preset name or explicit "M,K,N;M,K,N"
    net: str | None = (
        None  # emulated link rate for multi-rank suites, e.g. "2gbit"; None = loopback
    )
    out: Path | None = None  # where plots/traces may be written
    reps: int | None = None  # override the module's repetition count
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Stats:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int
    samples_ms: list[float]

    @property
    def spread(self) -> float:
        """Relative half-width of the p10..p90 band around the median."""
        return (self.p90_ms - self.p10_ms) / (2 * self.median_ms) if self.median_ms else 0.0


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats_of(samples_ms: list[float]) -> Stats:
    return Stats(
        statistics.median(samples_ms),
        _quantile(samples_ms, 0.1),
        _quantile(samples_ms, 0.9),
        min(samples_ms),
        len(samples_ms),
        list(samples_ms),
    )


def interleaved(
    variants: dict[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    reps: int = 10,
    sync: Callable[[], None] | None = None,
    before_each: Callable[[], None] | None = None,
    timer: Callable[[Callable[[], Any]], float] | None = None,
) -> dict[str, Stats]:
    """Time each variant ``reps`` times, interleaved, after ``warmup`` untimed rounds.

    ``sync`` runs after each call inside the timed region (``torch.cuda.synchronize``);
    ``before_each`` runs before each call outside it (e.g. a barrier across ranks).
    ``timer(fn) -> ms`` replaces the wall-clock timer (e.g. CUDA events, or a max over ranks).
    """

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return (time.perf_counter() - t0) * 1e3

    timer = timer or wall
    names = list(variants)
    for _ in range(warmup):
        for n in names:
            if before_each:
                before_each()
            timer(variants[n])
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        order = names if i % 2 == 0 else names[::-1]  # A B C, C B A: no variant always first
        for n in order:
            if before_each:
                before_each()
            samples[n].append(timer(variants[n]))
    return {n: stats_of(s) for n, s in samples.items()}


def max_over_ranks_timer(group=None) -> Callable[[Callable[[], Any]], float]:
    """``timer(fn) -> ms`` for :func:`interleaved` in multi-rank benchmarks: this rank's wall
    time of ``fn``, then the max over the ranks of ``group`` (a step ends with its slowest rank)."""
    import torch
    import torch.distributed as dist

    def timer(fn) -> float:
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    return timer


ROW_FIELDS = [
    "suite",
    "case",
    "variant",
    "ms",
    "ms_p10",
    "ms_p90",
    "reps",
    "tflops",
    "gbps",
    "hidden_frac",
    "peak_mem_mb",
    "speedup_vs_unfused",
    "status",
    "reason",
    "device",
    "dtype",
    "shape",
    "extra",
]


def row(
    suite: str,
    case: str,
    variant: str,
    st: Stats | None = None,
    *,
    flops: float | None = None,
    nbytes: float | None = None,
    status: str = "ok",
    reason: str = "",
    **kw: Any,
) -> dict:
    """One result row. A variant that cannot run here is a row with ``status="unavailable"``
    and its ``reason``: it is reported, never silently dropped."""
    r: dict[str, Any] = {k: None for k in ROW_FIELDS}
    r.update(suite=suite, case=case, variant=variant, status=status, reason=reason)
    if st is not None:
        r.update(ms=st.median_ms, ms_p10=st.p10_ms, ms_p90=st.p90_ms, reps=st.n)
        if flops:
            r["tflops"] = flops / (st.median_ms * 1e-3) / 1e12
        if nbytes:
            r["gbps"] = nbytes / (st.median_ms * 1e-3) / 1e9
    extra = {k: v for k, v in kw.items() if k not in ROW_FIELDS}
    r.update({k: v for k, v in kw.items() if k in ROW_FIELDS})
    if extra:
        r["extra"] = {**(r.get("extra") or {}), **extra}
    return r


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host_cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "git": _git_rev(),
    }


def write_rows(rows: list[dict], out_dir: Path, stem: str = "results") -> tuple[Path, Path]:
    """Write ``<stem>.json`` (rows + machine) and ``<stem>.csv`` (one line per row)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mach = machine_info()
    jp, cp = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    jp.write_text(json.dumps({"machine": mach, "rows": rows}, indent=1, default=str))
    cols = ROW_FIELDS + list(mach)
    with cp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(
                {**{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()}, **mach}
            )
    return jp, cp


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or [
        "case",
        "variant",
        "ms",
        "ms_p10",
        "ms_p90",
        "tflops",
        "hidden_frac",
        "speedup_vs_unfused",
        "status",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def as_dict(st: Stats) -> dict:
    return asdict(st)
