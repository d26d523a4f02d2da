"""PNG plots for ``distllm bench`` (matplotlib, Agg backend: no display needed).

- ``<suite>_speedup.png``: per suite, bars of the speed-up of each fused and peer variant
  over the unfused one, grouped by case (cases are unrelated shapes or layouts: no line
  joins them), with the band of :func:`~distllm.bench.report.speedup_band` (paired
  repetitions) as error bars; a suite with no unfused variant but
  peers (``train_e2e``: distllm against torch's own building blocks) shows the fused
  variants' speed-up over each case's fastest peer; one with neither, time (ms) per case.
- ``<suite>_timeline.png``: for the overlap suites, one step drawn as bars on lanes, so that a
  reader sees how much communication runs under compute.

Timeline contract (for benchmark modules): a row may carry
``row["extra"]["timeline"] = [{"lane": "compute" | "comm", "name": str, "start_ms": float,
"end_ms": float}, ...]`` for one representative step, times relative to the step's start
(any origin works: the plot subtracts the smallest ``start_ms``). Other lane names are
allowed (e.g. ``"comm:bucket"``, ``"rank1 compute"``); each distinct lane is one row of
bars. Rows of one case with a timeline are drawn one above the other, so the sequential and
overlapped variants can be compared by eye.
"""

from __future__ import annotations

import re
from pathlib import Path

from distllm.bench.report import by_case, role_of, speedup_band

__all__ = ["plot_all", "plot_speedup", "plot_timeline", "plot_events"]

_MAX_TIMELINES = 4


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and isinstance(r.get("ms"), int | float) and r["ms"] > 0


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _speedup_series(rows: list[dict]) -> tuple[list[str], dict[str, list[tuple]], str]:
    """cases, per variant a list of (case index, lo, mid, hi) speed-ups, and what they are
    over: each case's unfused variant, or (a suite with none, e.g. distllm against torch's
    own building blocks) its fastest peer, the fused variants then measured against it."""
    cases = by_case(rows)
    labels = [c for (_, c) in cases]
    series: dict[str, list[tuple]] = {}
    over = "unfused"
    has_unfused = any(_ok(r) and role_of(r) == "unfused" for r in rows)
    for i, crows in enumerate(cases.values()):
        base_role, shown = ("unfused", ("fused", "peer", "ideal")) if has_unfused else (
            "peer", ("fused",))
        base = [r for r in crows if _ok(r) and role_of(r) == base_role]
        if not base:  # (its baseline failed or was skipped: an empty slot, said so)
            labels[i] = f"{labels[i]}\n(no {base_role} row)"
            continue
        b = min(base, key=lambda r: r["ms"])
        for r in crows:
            if _ok(r) and role_of(r) in shown:
                series.setdefault(str(r["variant"]), []).append((i, *speedup_band(b, r)))
    if not has_unfused:
        over = "fastest peer"
    return labels, series, over


def _bars(ax, series: dict[str, list[tuple]], label: str = "{:.2f}x") -> None:
    """Grouped bars, one group per case (cases are unrelated: nothing joins them), one bar
    per variant, the p10..p90 band as an error bar, the median written on the bar in the
    format ``label`` (a speed-up's by default)."""
    n = len(series)
    width = 0.8 / max(n, 1)
    for j, (name, pts) in enumerate(series.items()):
        xs = [p[0] + (j - (n - 1) / 2) * width for p in pts]
        mids = [p[2] for p in pts]
        err = [[max(0.0, m - p[1]) for m, p in zip(mids, pts, strict=True)],
               [max(0.0, p[3] - m) for m, p in zip(mids, pts, strict=True)]]
        hatch = "//" if "ideal" in name else None
        bars = ax.bar(xs, mids, width=width * 0.9, yerr=err, capsize=3, label=name,
                      hatch=hatch, color=f"C{j}", alpha=0.85)
        for bar, m, p in zip(bars, mids, pts, strict=True):
            ax.annotate(label.format(m), (bar.get_x() + bar.get_width() / 2, max(m, p[3])),
                        textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6)


def plot_speedup(rows: list[dict], suite: str, out_dir: Path) -> Path | None:
    """Draw ``<suite>_speedup.png``: speed-up bars per case (or time per case with no
    baseline); None if no data."""
    labels, series, over = _speedup_series(rows)
    timed = not series
    if timed:
        for i, crows in enumerate(by_case(rows).values()):
            for r in crows:
                if _ok(r):
                    ms = r["ms"]
                    lo, hi = r.get("ms_p10") or ms, r.get("ms_p90") or ms
                    series.setdefault(str(r["variant"]), []).append((i, lo, ms, hi))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 3), 4.2))
    _bars(ax, series, "{:.3g} ms" if timed else "{:.2f}x")
    ax.set_xticks(range(len(labels)))
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    if timed:
        ax.set_ylabel("time per call, ms (median, p10..p90)")
        ax.set_yscale("log")
    else:
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_ylabel(f"speed-up over {over}")
    ax.set_title(f"{suite}: {'time' if timed else 'speed-up'} by case")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = Path(out_dir) / f"{_safe(suite)}_speedup.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _timeline_rows(rows: list[dict]) -> list[dict]:
    """Rows of the first case that has any timeline, at most ``_MAX_TIMELINES``."""
    for crows in by_case(rows).values():
        tl = [r for r in crows if isinstance(r.get("extra"), dict)
              and isinstance(r["extra"].get("timeline"), list) and r["extra"]["timeline"]]
        if tl:
            return tl[:_MAX_TIMELINES]
    return []


def _draw_lanes(ax, events: list[dict]) -> None:
    t0 = min(float(e["start_ms"]) for e in events)
    span = max(float(e["end_ms"]) for e in events) - t0 or 1.0
    lanes = list(dict.fromkeys(str(e.get("lane", "?")) for e in events))
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for y, lane in enumerate(lanes):
        col = colors.get(lane.split(":")[0].split()[-1], f"C{y + 2}")
        for e in (e for e in events if str(e.get("lane", "?")) == lane):
            s, w = float(e["start_ms"]) - t0, float(e["end_ms"]) - float(e["start_ms"])
            ax.broken_barh([(s, w)], (y - 0.35, 0.7), facecolors=col, edgecolor="black",
                           linewidth=0.4)
            if e.get("name") and w > 0.06 * span:  # label only bars wide enough to read
                ax.text(s + w / 2, y, str(e["name"]), ha="center", va="center", fontsize=6,
                        clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(rows: list[dict], suite: str, out_dir: Path) -> Path | None:
    """Draw ``<suite>_timeline.png`` from rows' ``extra.timeline``; None if none has one."""
    tl = _timeline_rows(rows)
    if not tl:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(tl), 1, figsize=(9, 1.0 + 1.3 * len(tl)), squeeze=False,
                             sharex=True)
    for ax, r in zip(axes[:, 0], tl, strict=True):
        _draw_lanes(ax, r["extra"]["timeline"])
        hid = r.get("hidden_frac")
        hid_s = f", hid {100 * hid:.0f}% of the hideable" if isinstance(hid, int | float) else ""
        ax.set_title(f"{r['variant']} ({r.get('case')}){hid_s}", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the start of the step")
    fig.suptitle(f"{suite}: one step, compute and communication", fontsize=10)
    fig.tight_layout()
    p = Path(out_dir) / f"{_safe(suite)}_timeline.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_events(events: list[dict], title: str, path: Path) -> Path | None:
    """One timeline (events as in the contract above) as a PNG at ``path``."""
    if not events:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 2.4))
    _draw_lanes(ax, events)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms from the start of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_all(rows: list[dict], out_dir: Path, overlap_suites: set[str] | None = None
             ) -> dict[str, list[str]]:
    """Every plot for every suite in ``rows``; returns suite -> PNG file names written.

    Timelines are drawn for any suite whose rows carry one (``overlap_suites`` only limits
    which suites are looked at when given)."""
    out: dict[str, list[str]] = {}
    for s in dict.fromkeys(r["suite"] for r in rows):
        srows = [r for r in rows if r["suite"] == s]
        names = []
        p = plot_speedup(srows, s, out_dir)
        if p is not None:
            names.append(p.name)
        if overlap_suites is None or s in overlap_suites:
            p = plot_timeline(srows, s, out_dir)
            if p is not None:
                names.append(p.name)
        out[s] = names
    return out
