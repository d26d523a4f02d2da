"""REPORT.md: one table per suite with the speed-ups of fused over unfused and over the peer,
and a one-line verdict per case (:mod:`distllm.bench.verdicts`: the roles, the bands,
the flags and the verdicts)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distllm.bench.rows import fmt, write_text_atomic
from distllm.bench.verdicts import (  # (verdicts' public names are the report's too)
    _best,
    _ok,
    _samples,
    above_ceiling,
    annotate,
    below_floor,
    below_ideal,
    beyond_spread,
    by_case,
    role_of,
    speedup_band,
    verdict,
)

from distllm.diagnostics.timing import PAIRED_MIN

__all__ = ["role_of", "annotate", "verdict", "suite_table", "write_report", "by_case",
           "speedup_band", "not_measured", "summary_table", "above_ceiling", "below_floor",
           "below_ideal", "beyond_spread"]

CEILING_MARK = "⚠"
UNRESOLVED_MARK = "n/r"
UNRESOLVED_NOTE = (f"{UNRESOLVED_MARK}: hidden share not resolved: what could hide is within the "
                   "spread of its parts timed alone (extra.hidden_unresolved), so the share would "
                   "be noise.")
CEILING_NOTE = (f"{CEILING_MARK}: hidden above its ceiling (100% of what could hide), which "
                "no overlap can do: the measurement of that row is wrong, not the overlap.")
IDEAL_NOTE = (f"{CEILING_MARK} beside a time: faster than its case's ideal bound (the parts "
              "overlapped at best) beyond its spread, which no schedule can be: the "
              "measurement of that row is wrong or noisy, and no verdict rests on it.")
FLOOR_NOTE = (f"{CEILING_MARK}: hidden below the floor its suite sets, or computed from parts "
              "that do not add up to the step without overlap beyond their spread: the parts "
              "do not explain that row's time, so its share is not a measure of the overlap.")

_COLS = ["case", "variant", "role", "ms", "p10..p90", "TFLOP/s", "GB/s", "hidden",
         "peak MiB", "vs unfused", "vs peer", "status"]


def _cells(r: dict) -> list[str]:
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    band = f"{fmt(r.get('ms_p10'))}..{fmt(r.get('ms_p90'))}" if r.get("ms_p10") else ""
    status = r.get("status") or ""
    if status != "ok":
        status = _why(r)[:160]
    part = role_of(r) == "part"  # a component timed alone: no speed-up to claim
    sp = None if part else r.get("speedup_vs_unfused")
    spp = None if part else extra.get("speedup_vs_peer")
    return [str(r.get("case")), str(r.get("variant")), role_of(r), _ms_cell(r), band,
            fmt(r.get("tflops")), fmt(r.get("gbps")), _hidden_cell(r),
            fmt(r.get("peak_mem_mb")), f"{sp:.2f}x" if sp else "",
            f"{spp:.2f}x" if spp else "", status.replace("|", "/").replace("\n", " ")]


def _unresolved(r: dict) -> bool:
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    return bool(extra.get("hidden_unresolved"))


def _ms_cell(r: dict) -> str:
    """A row's median time, marked where it is below its case's ideal bound."""
    return fmt(r.get("ms")) + (f" {CEILING_MARK}" if below_ideal(r) else "")


def _hidden_cell(r: dict) -> str:
    hid = r.get("hidden_frac")
    if not isinstance(hid, int | float):
        return UNRESOLVED_MARK if _unresolved(r) else ""
    extra = r.get("extra") if isinstance(r.get("extra"), dict) else {}
    band = extra.get("hidden_band")
    ok = isinstance(band, list | tuple) and len(band) == 2 and all(
        isinstance(x, int | float) for x in band)
    lo, hi = (min(band[0], hid), max(band[1], hid)) if ok else (None, None)  # holds the share
    return (f"{100 * hid:.0f}%" + (f" ({100 * lo:.0f}..{100 * hi:.0f})" if ok else "")
            + (f" {CEILING_MARK}" if above_ceiling(r) or below_floor(r) else ""))


def _ceiling_note(rows: Iterable[dict]) -> list[str]:
    rows = list(rows)
    notes = [CEILING_NOTE] if any(above_ceiling(r) for r in rows) else []
    notes += [FLOOR_NOTE] if any(below_floor(r) for r in rows) else []
    notes += [IDEAL_NOTE] if any(below_ideal(r) for r in rows) else []
    notes += [UNRESOLVED_NOTE] if any(_unresolved(r) for r in rows) else []
    return [""] + notes if notes else []


def _why(r: dict) -> str:
    status, reason = str(r.get("status") or ""), str(r.get("reason") or "")
    while reason.lower().startswith(status.lower() + ":"):  # "unavailable: unavailable: ..."
        reason = reason[len(status) + 1:].strip()
    return f"{status}: {reason}" if reason else status


def not_measured(rows: list[dict]) -> list[str]:
    """One line per (variant, reason) that did not run, with how many cases it covers."""
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.get("status") != "ok":
            k = (_what(r), _why(r).replace("\n", " "))
            seen[k] = seen.get(k, 0) + 1
    return [f"- {v}: {why}" + (f" ({n} cases)" if n > 1 else "") for (v, why), n in seen.items()]


def _what(r: dict) -> str:
    """What a row that did not run stands for: its variant; for a failure row (variant
    ``-``), its case, or the whole suite when the case is ``-`` too."""
    if str(r.get("variant")) != "-":
        return str(r.get("variant"))
    return "the whole suite" if str(r.get("case")) == "-" else f"case `{r.get('case')}`"


def suite_table(rows: list[dict]) -> str:
    """A markdown table of one suite's measured rows (one line per case and variant), then a
    list of what could not be measured here and why."""
    ok = [r for r in rows if r.get("status") == "ok"]
    lines = []
    if ok:
        lines += ["| " + " | ".join(_COLS) + " |", "|" + "---|" * len(_COLS)]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in ok]
        lines += _ceiling_note(ok)
    missing = not_measured(rows)
    if missing:
        lines += ([""] if ok else []) + ["Not measured here:", ""] + missing
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """One line per case over all suites: baseline (the unfused variant, else the best peer),
    best fused variant, speed-up with its p10..p90 band, hidden share, and the verdict; a
    case where no fused variant ran (one that failed, say) has ``-`` for best and its
    verdict says why."""
    lines = ["| suite | case | baseline ms | best | its ms | speed-up (band) | hidden | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    shown = []
    for (suite, case), crows in by_case(rows).items():
        base, best = _best(crows, "unfused") or _best(crows, "peer"), _best(crows, "fused")
        b = f"{_ms_cell(base)} ({base['variant']})" if base else ""
        v = verdict(crows).replace("|", "/").replace("\n", " ")
        if best is None:  # no fused variant ran: the line says why (the verdict)
            lines.append(f"| {suite} | {case} | {b} | - |  |  |  | {v} |")
            continue
        shown += [best] + ([base] if base is not None else [])
        sp = ""
        if base is not None:
            lo, mid, hi = speedup_band(base, best)
            sp = f"{mid:.2f}x ({lo:.2f}..{hi:.2f})"
        lines.append(f"| {suite} | {case} | {b} | {best['variant']} | {_ms_cell(best)} | "
                     f"{sp} | {_hidden_cell(best)} | {v} |")
    return "\n".join(lines + _ceiling_note(shown))


def _header(machine: dict[str, Any], meta: dict[str, Any], unpaired: bool = False,
            on_gpu: bool = True) -> list[str]:
    """``unpaired``: some rows ran fewer repetitions than a paired band needs; ``on_gpu``:
    some row ran on CUDA (else the host's GPU is named as unused)."""
    m = machine
    out = ["# distllm bench report", ""]
    if meta.get("command"):
        out += [f"Command: `{meta['command']}`", ""]
    out.append(f"- time: {m.get('time')}, git {m.get('git')}; torch {m.get('torch')} "
               f"(CUDA {m.get('cuda')}), triton {m.get('triton')}, Python {m.get('python')}")
    unused = " (unused by these rows)" if m.get("gpu") and not on_gpu else ""
    out.append(f"- machine: {m.get('host_cpu')}, {m.get('cores')} cores; GPU: {m.get('gpu')}"
               + unused)
    if meta.get("loadavg") is not None:
        out.append(f"- load average at start / end: {meta['loadavg']} (other processes on "
                   "the machine disturb absolute times; ratios within a run stay comparable)")
    out += ["- speed-ups are ratios of medians from the same run; their band is the 10th-90th "
            "percentile of the ratios of repetitions run in the same round (variants "
            "interleaved)" + (
                f"; where a variant ran fewer than {PAIRED_MIN} repetitions (as here: "
                f"--quick, or a low --reps), the widest ratio of the two p10..p90 bands"
                if unpaired else "") + "; 'wins' means the whole band is above 1 and, "
            "where rounds pair, at least ceil(0.9 n) of the n rounds' ratios are above 1 too", ""]
    return out


def _unpaired(rows: list[dict]) -> bool:
    """Whether a measured row has too few repetitions for a paired band."""
    return any(_ok(r) and role_of(r) != "ideal" and len(_samples(r) or ()) < PAIRED_MIN
               for r in rows)


def write_report(rows: list[dict], machine: dict[str, Any], out_dir: Path,
                 meta: dict[str, Any] | None = None, titles: dict[str, str] | None = None,
                 plots: dict[str, list[str]] | None = None) -> Path:
    """Write ``out_dir/REPORT.md`` and return its path. ``plots`` maps suite -> PNG names."""
    meta, titles, plots = meta or {}, titles or {}, plots or {}
    on_gpu = any(_ok(r) and str(r.get("device") or "").startswith("cuda") for r in rows)
    lines = _header(machine, meta, _unpaired(rows), on_gpu) + [
        "## Summary", "", summary_table(rows), ""]
    suites = list(OrderedDict.fromkeys(r["suite"] for r in rows))
    for s in suites:
        srows = [r for r in rows if r["suite"] == s]
        secs = (meta.get("elapsed_s") or {}).get(s)
        took = f" ({secs:.1f} s)" if isinstance(secs, int | float) else ""
        lines += [f"## {s}: {titles.get(s, '')}{took}".rstrip(": "), "", suite_table(srows), ""]
        lines += ["Verdicts:", ""]
        for (_, case), crows in by_case(srows).items():
            lines.append(f"- `{case}`: {verdict(crows)}")
        lines.append("")
        lines += [f"![{p}]({p})" for p in plots.get(s, [])]
        if plots.get(s):
            lines.append("")
    return write_text_atomic(Path(out_dir) / "REPORT.md", "\n".join(lines))


def loadavg() -> str | None:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return None
