"""Result rows of ``distllm bench``: one dict per (suite, case, variant), written as JSON and
CSV with the machine they were measured on, and shown as markdown tables.

A row's fixed fields are :data:`ROW_FIELDS`; anything else goes to ``row["extra"]`` (a
dict): ``samples_ms``, every repetition in the order it ran (the paired speed-up bands of
:mod:`distllm.bench.report`), and what a suite records, e.g. a ``timeline`` of one step
(lanes ``compute`` / ``comm``, drawn by :mod:`distllm.bench.plots`) or the variant's
``role`` in the report. A variant that cannot run here is a row with
``status="unavailable"`` and its ``reason``: reported, never dropped.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from distllm.diagnostics.timing import Stats
from distllm.files import write_text_atomic

__all__ = ["ROW_FIELDS", "row", "machine_info", "write_rows", "write_text_atomic",
           "markdown_table", "fmt", "judge_target"]


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
        # every repetition in the order it ran: the report pairs repetition i of two
        # variants (interleaved, so they ran in the same round) for the band of their ratio
        kw.setdefault("samples_ms", [round(x, 4) for x in st.samples_ms])
        if flops:
            r["tflops"] = flops / (st.median_ms * 1e-3) / 1e12
        if nbytes:
            r["gbps"] = nbytes / (st.median_ms * 1e-3) / 1e9
    extra = {k: v for k, v in kw.items() if k not in ROW_FIELDS}
    r.update({k: v for k, v in kw.items() if k in ROW_FIELDS})
    if extra:
        r["extra"] = {**(r.get("extra") or {}), **extra}
    return r


def judge_target(*checks: tuple[float, tuple[float, float] | None, float]) -> dict:
    """Whether figures meet their targets ``figure <= limit``, each check ``(median, band,
    limit)`` with ``band`` the figure's p10..p90 taken round by round (None: no per-round
    values), as ``extra`` fields: ``target_status`` "met" where every band lies within its
    limit, "missed" where a whole band lies beyond, else "within the spread";
    ``target_band`` (the bands, each widened to hold its median); ``target_judged_on``: the
    bands, or the medians alone where a check has none (then its band is its median)."""
    bands = [(min(b[0], v), max(b[1], v)) if b is not None else (v, v) for v, b, _ in checks]
    lims = [lim for _, _, lim in checks]
    status = ("met" if all(hi <= lim for (_, hi), lim in zip(bands, lims, strict=True))
              else "missed" if any(lo > lim for (lo, _), lim in zip(bands, lims, strict=True))
              else "within the spread")
    per_round = all(b is not None for _, b, _ in checks)
    return {"target_status": status, "target_band": [list(b) for b in bands],
            "target_judged_on": "p10..p90 round by round" if per_round
            else "median (no per-round values)"}


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


def write_rows(rows: list[dict], out_dir: Path, stem: str = "results",
               run: dict | None = None) -> tuple[Path, Path]:
    """Write ``<stem>.json`` (rows + machine, and ``run``: the command and config, where
    given) and ``<stem>.csv`` (one line per row), each whole or not at all."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mach = machine_info()
    jp, cp = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    data = {"machine": mach, "rows": rows, **({} if run is None else {"run": run})}
    write_text_atomic(jp, json.dumps(data, indent=1, default=str))
    cols = ROW_FIELDS + list(mach)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow(
            {**{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()}, **mach}
        )
    write_text_atomic(cp, buf.getvalue())
    return jp, cp


def fmt(v: Any) -> str:
    """A table cell: 3 significant digits below 100, one decimal above; '' for None."""
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
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)
